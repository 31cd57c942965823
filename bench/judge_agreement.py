"""Judge agreement benchmark (docs/benchmarks/judge.md): does the built-in judge model (zoo/search/judge.py,
docs/models.md "The judge model") agree with the exact verifier (loom/exact.py) on held-out answers?

Answers: for held-out Countdown and arithmetic problems (the search model's held-out split), the search
model's own samples at temperature 1 (``loom engine --model search``), one generated wrong answer
(zoo.search.judge's slips) and one right trace in a drawn move order; every answer labelled by the
exact verifier. Judges: ``loom engine --model judge`` and the vLLM CPU build (``.venv-vllm``) serving the
same checkpoint, each through the reward core's ``judge`` component (``reward_svc.core.ascore_group``
with ``loom.clients.JudgeClient``, template ``arith``) in ``verdict`` and ``logprob`` modes. Printed:
agreement with the exact verifier and the confusion table, per judge and mode; and the process-reward
skill's agreement on held-out steps (the same server, P(yes) of the first token). The vLLM leg is
skipped with the reason when it cannot start.

    .venv/bin/python bench/judge_agreement.py [--problems 30] [--samples 2] [--no-vllm] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.rollout import Procs, free_port, start_engine_server  # noqa: E402
from loom.clients.judge import JudgeAsk, JudgeClient  # noqa: E402
from loom.contracts.reward_settings import JudgeServer  # noqa: E402
from loom.contracts.wire import Group, RewardComponent, RewardSpec, Trajectory  # noqa: E402
from reward_svc.core import ascore_group  # noqa: E402
from reward_svc.judge import LOGPROBS, p_yes  # noqa: E402
from zoo.registry import resolve_model_path  # noqa: E402
from zoo.search import judge as jm  # noqa: E402
from zoo.search.tasks import search_problems  # noqa: E402
from zoo.tiny.tasks import HELDOUT_SEED, Problem  # noqa: E402

MAX_TOKENS = 400  # the search model's plain budget (zoo/search/reflect.py BUDGETS)


async def _no_verify(items: Any, timeout: int) -> list[Any]:
    return []


def model_id(url: str) -> str:
    return str(httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"])


def sample(url: str, problems: list[Problem], n: int, seed: int) -> list[list[str]]:
    """The search model's ``n`` samples per problem at temperature 1."""
    model = model_id(url)
    out = []
    with httpx.Client(timeout=600) as http:
        for i, p in enumerate(problems):
            body = {"model": model, "prompt": f"[plain] {p.text}\n", "n": n, "temperature": 1.0}
            body |= {"max_tokens": MAX_TOKENS, "seed": seed + i}
            r = http.post(f"{url}/v1/completions", json=body)
            r.raise_for_status()
            out.append([c["text"] for c in r.json()["choices"]])
    return out


def build_groups(problems: list[Problem], samples: list[list[str]]) -> tuple[list[Group], dict[str, tuple]]:
    """One group per problem; ``meta``: trajectory id -> (kind, source, exact label)."""
    groups, meta = [], {}
    for i, (p, got) in enumerate(zip(problems, samples, strict=True)):
        rng = random.Random(f"{p.key}/bench/{i}")
        right = jm.completion_of(p, 7 + i)
        wrong = (jm.wrong_countdown if p.kind == "countdown" else jm.wrong_arith)(p, right, rng)
        texts = [("sampled", t) for t in got] + [("generated wrong", wrong), ("right trace", right)]
        trajs = []
        for j, (source, text) in enumerate(texts):
            tid = f"{i}-{j}"
            meta[tid] = (p.kind, source, jm.exact_right(p, text))
            trajs.append(Trajectory(id=tid, group_id=f"g{i}", text=text))
        groups.append(
            Group(id=f"g{i}", prompt=f"[plain] {p.text}\n", label=jm.reference_of(p), trajectories=trajs)
        )
    return groups, meta


async def judge_groups(client: JudgeClient, groups: list[Group], mode: str) -> dict[str, tuple[str, float]]:
    params = {"judge": "judge", "template": "arith", "mode": mode, "max_tokens": 4, "timeout_s": 300}
    spec = RewardSpec(components=[RewardComponent(name="judge", params=params)])
    results = await asyncio.gather(
        *(ascore_group(g, spec, _no_verify, ask_judge=client.ask_batch) for g in groups)
    )
    return {r.trajectory_id: (r.status, r.components["judge"]) for res in results for r in res.rewards}


async def process_agreement(client: JudgeClient, n: int) -> dict[str, Any]:
    """The process-reward skill on held-out steps: P(yes) of the first token > 0.5 against the label."""
    exs = [e for name, es in jm.heldout_examples(n).items() if name.startswith("process") for e in es]
    asks = [JudgeAsk("judge", e.prompt, 1, 300, LOGPROBS) for e in exs]
    replies = await client.ask_batch(asks)
    scores = [p_yes(r.first_tops) if r.status == "ok" else None for r in replies]
    agree = sum(s is not None and (s > 0.5) == e.right for s, e in zip(scores, exs, strict=True))
    return {"agree": agree, "total": len(exs), "unread": sum(s is None for s in scores)}


def tally(verdicts: dict[str, tuple[str, float]], meta: dict[str, tuple], mode: str) -> dict[str, Any]:
    """Agreement and the confusion table (judge yes/no/unread against exact right/wrong), overall and
    per kind and source."""
    cells: Counter = Counter()
    for tid, (status, score) in verdicts.items():
        kind, source, right = meta[tid]
        said = (
            "unread"
            if status != "ok"
            else ("yes" if (score > 0.5 if mode == "logprob" else score == 1.0) else "no")
        )
        truth = "right" if right else "wrong"
        for key in ("all", kind, source):
            cells[(key, said, truth)] += 1
    out = {}
    for key in sorted({k for k, _, _ in cells}):
        c = {f"{s}/{t}": cells[(key, s, t)] for s in ("yes", "no", "unread") for t in ("right", "wrong")}
        total = sum(c.values())
        agree = c["yes/right"] + c["no/wrong"]
        out[key] = {"agreement": round(agree / max(1, total), 3), "n": total, **c}
    return out


def print_table(name: str, mode: str, table: dict[str, Any]) -> None:
    print(f"\n{name} [{mode}]  agreement with the exact verifier")
    print(f"{'answers':18s} {'n':>4s} {'agree':>6s}  yes/right yes/wrong no/right no/wrong unread")
    for key, r in table.items():
        unread = r["unread/right"] + r["unread/wrong"]
        print(
            f"{key:18s} {r['n']:4d} {r['agreement']:6.3f}  {r['yes/right']:9d} {r['yes/wrong']:9d}"
            f" {r['no/right']:8d} {r['no/wrong']:8d} {unread:6d}"
        )


async def run_judge(name: str, url: str, groups: list[Group], meta: dict, n_process: int) -> dict[str, Any]:
    client = JudgeClient(
        {"judge": JudgeServer(url=url, model=model_id(url), max_concurrency=8)}, cache_size=0
    )
    out: dict[str, Any] = {}
    for mode in ("verdict", "logprob"):
        t0 = time.perf_counter()
        table = tally(await judge_groups(client, groups, mode), meta, mode)
        out[mode] = {"seconds": round(time.perf_counter() - t0, 1), "table": table}
        print_table(name, mode, table)
    out["process"] = await process_agreement(client, n_process)
    p = out["process"]
    print(f"{name} process-reward steps: agreement {p['agree']}/{p['total']} (unread {p['unread']})")
    return out


def start_vllm(tmp: Path, model: str = "judge") -> tuple[Any, str] | str:
    """The vLLM CPU build serving the judge checkpoint (``model``: a built-in name or a checkpoint
    directory), or the reason it could not start."""
    from rollout_svc.config import VllmSettings
    from rollout_svc.engines.vllm_launch import VLLMServer, vllm_command, vllm_env, vllm_python

    py = vllm_python(VllmSettings().python)
    if not py.exists():
        return f"no vLLM environment at {py} (docs/vllm.md)"
    cmd = vllm_command(py, resolve_model_path(model), free_port(), served_name="judge", max_model_len=1024)
    try:
        server = VLLMServer(cmd, vllm_env(), tmp / "vllm.log").start(timeout_s=900)
    except RuntimeError as e:
        return str(e)
    return server, server.url


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", type=int, default=30, help="held-out problems per kind")
    ap.add_argument("--samples", type=int, default=2, help="the search model's samples per problem")
    ap.add_argument("--process", type=int, default=40, help="held-out process steps per kind")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    problems = [
        p for k in ("countdown", "arith") for p in search_problems(k, args.problems, HELDOUT_SEED, "test")
    ]  # type: ignore[arg-type]
    procs, report = Procs(), {"args": vars(args) | {"json": str(args.json)}}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        try:
            policy = start_engine_server(procs, tmp, ["--model", "search"], LOOM_TORCH_THREADS="2")
            groups, meta = build_groups(problems, sample(policy, problems, args.samples, args.seed))
            procs.close()
            report["labels"] = dict(
                Counter(f"{k}/{s}/{'right' if r else 'wrong'}" for k, s, r in meta.values())
            )
            print("answers:", report["labels"])
            url = start_engine_server(procs, tmp, ["--model", "judge"], LOOM_TORCH_THREADS="2")
            report["loom engine"] = asyncio.run(run_judge("loom engine", url, groups, meta, args.process))
            procs.close()
            vllm = "skipped (--no-vllm)" if args.no_vllm else start_vllm(tmp)
            if isinstance(vllm, str):
                print(f"\nvLLM CPU leg skipped: {vllm}")
                report["vllm"] = {"skipped": vllm}
            else:
                server, vurl = vllm
                try:
                    report["vllm"] = asyncio.run(run_judge("vLLM CPU", vurl, groups, meta, args.process))
                finally:
                    server.stop()
        finally:
            procs.close()
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
