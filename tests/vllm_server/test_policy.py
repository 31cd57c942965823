"""Full-checkpoint policy updates on the real vLLM through the vllm client (docs/vllm.md): a reload
serves exactly the new weights (tied head included), requests in flight finish on the weights they are
labelled with, a bad checkpoint is a ``PolicyLoadError`` that leaves the old version served, the
server's version is read (never assumed) at start, and a 500 does not cost the next request."""

from __future__ import annotations

import asyncio
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from loom.contracts.settings import Settings
from loom.contracts.wire import Group, PolicyVersion, RolloutRequest, SamplingParams
from loom.store import PolicyStore
from rollout_svc.engines.base import PolicyLoadError
from rollout_svc.engines.vllm import VLLMEngine, weight_label
from rollout_svc.rollout import generate_group
from tests.vllm_server.conftest import TINY, changed_checkpoint, max_diff, reference_logprobs

ATOL = 1e-4


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> PolicyStore:
    """Versions 1 and 2: the tiny model with its weights moved (two different seeds)."""
    s = PolicyStore(tmp_path_factory.mktemp("policy"))
    for v in (1, 2):
        s.publish(v, lambda d, v=v: changed_checkpoint(d, seed=v) and None)
    return s


@pytest.fixture
def engine(vllm: Any, arun: Any, store: PolicyStore) -> Any:
    url = vllm.ensure("raw")
    e = VLLMEngine(url, policy_store=store.root, retries=1)
    arun(e.load_policy(PolicyVersion(version=0, path=str(TINY))))  # every test starts on the base model
    yield e
    arun(e.close())


def _sample(arun: Any, engine: VLLMEngine, prompt_ids: list[int], seed: int = 3, **kw: Any) -> Any:
    params = SamplingParams(n=2, max_tokens=24, seed=seed, **kw)
    return arun(engine.generate(prompt_ids, params))


def _matches(path: Path | str, prompt_ids: list[int], outs: Any) -> float:
    return max(max_diff(c.logprobs, reference_logprobs(path, prompt_ids, c.token_ids)) for c in outs)


def test_a_reload_serves_the_new_weights_tied_head_included(
    engine: VLLMEngine, arun: Any, store: PolicyStore, prompt_ids: list[int]
) -> None:
    base = _sample(arun, engine, prompt_ids)
    assert _matches(TINY, prompt_ids, base) < ATOL
    for v in (1, 2):
        policy = store.get(v)
        assert policy is not None
        arun(engine.load_policy(policy))
        outs = _sample(arun, engine, prompt_ids)
        # the tiny model ties lm_head to the embeddings: vLLM's reload alone leaves the head old (0.44)
        assert _matches(policy.path, prompt_ids, outs) < ATOL
        assert _matches(TINY, prompt_ids, outs) > 0.05  # the change is visible
        assert engine.policy_version == v
        info = httpx.get(f"{engine.base_url}/weight_info", timeout=10).json()
        assert json.loads(info["weight_version"])["loom_policy_version"] == v
        assert httpx.get(f"{engine.base_url}/is_paused", timeout=10).json() == {"is_paused": False}


def _counts(url: str) -> tuple[float, float]:
    """The requests the server runs now and the tokens it has generated so far (its metrics)."""
    values = {"vllm:num_requests_running": 0.0, "vllm:generation_tokens_total": 0.0}
    for line in httpx.get(f"{url}/metrics", timeout=60).text.splitlines():
        name = line.split("{", 1)[0]
        if name in values:
            values[name] += float(line.rsplit(" ", 1)[1])
    return values["vllm:num_requests_running"], values["vllm:generation_tokens_total"]


def _paused(url: str) -> bool:
    return bool(httpx.get(f"{url}/is_paused", timeout=60).json()["is_paused"])


def _reading(url: str) -> tuple[bool, float]:
    """Paused or not, then the tokens generated so far: one reading of the watcher, in one thread hop."""
    return _paused(url), _counts(url)[1]


@dataclass
class Reload:
    """One try of the reload scenario: what came back, and whether requests were in flight."""

    early: list[Group]
    late: Group
    aborted: int  # requests the update cut (abort mode), which the client sent again
    decoded_while_paused: bool  # the server went on decoding under the update's pause (wait mode)


async def reload_under_requests(
    engine: VLLMEngine, v1: PolicyVersion, prompt_ids: list[int], tokenizer: Any
) -> Reload:
    """Start two groups of 48 whose requests cannot end before the context is full (``ignore_eos``,
    ``max_tokens`` filling the 512-token context), update to ``v1`` as soon as the server runs them
    (its gauge, read once it has generated a token of theirs), watching the server; then a small
    group on the new weights.

    The condition is made, not hoped for: the early requests need ~500 decode steps, whatever the
    machine's speed, and the update starts after the first of them (milliseconds later on an idle
    machine, where those steps take a second or more; both slow down together under load)."""
    url = engine.base_url
    await engine.load_policy(PolicyVersion(version=0, path=str(TINY)))
    settings = Settings()
    room = 512 - len(prompt_ids)  # the server's --max-model-len (tests/vllm_server/conftest.py)
    # 2 x 48 sequences: on an idle machine 2 x 2 of them (2,000 tokens) were all decoded within the
    # 0.19 s the update took to pause (the vLLM server's CPU build decodes the tiny model that fast),
    # so the update found nothing in flight in 3 of 3 tries; 2 x 16 passed idle but, beside a TRL
    # run (load 3-4 on 2 cores), drained between the watcher's readings in 3 of 3 tries; ~46,000
    # tokens keep the drain many readings long
    long = SamplingParams(n=48, max_tokens=room, seed=1, ignore_eos=True)
    aborted_before = engine.stats.extra.get("aborted_requests", 0)
    _, generated_before = await asyncio.to_thread(_counts, url)
    early = [
        asyncio.create_task(
            generate_group(
                # version 0 or newer: the base while it runs, v1 where abort sends it again after the update
                RolloutRequest(prompt_ids=prompt_ids, sampling=long, group_id=f"e{i}", policy_version=0),
                engine,
                lambda: tokenizer,
                settings,
            )
        )
        for i in range(2)
    ]
    # a try whose groups ended first (a process starved that long) shows nothing: the caller retries
    while not all(t.done() for t in early):
        running, generated = await asyncio.to_thread(_counts, url)
        if running > 0 and generated > generated_before:  # a gauge from after they started
            break
        await asyncio.sleep(0.02)
    update = asyncio.create_task(engine.load_policy(v1))
    decoded_while_paused = False
    polls: list[tuple[bool, float]] = []  # (paused, then tokens generated so far), in turn
    while engine.pause_mode == "wait" and not update.done() and not decoded_while_paused:
        polls.append(await asyncio.to_thread(_reading, url))
        if len(polls) >= 3:  # tokens came between two readings that the one pause encloses
            (paused_0, generated_0), (_, generated_1), (paused_2, _) = polls[-3:]
            decoded_while_paused = paused_0 and paused_2 and generated_1 > generated_0
        await asyncio.sleep(0.01)
    await update
    short = SamplingParams(n=2, max_tokens=16, seed=2)
    late = await generate_group(
        RolloutRequest(prompt_ids=prompt_ids, sampling=short, group_id="late", policy_version=v1.version),
        engine,
        lambda: tokenizer,
        settings,
    )
    aborted = int(engine.stats.extra.get("aborted_requests", 0) - aborted_before)
    return Reload(list(await asyncio.gather(*early)), late, aborted, decoded_while_paused)


@pytest.mark.parametrize("pause_mode", ["wait", "abort"])
def test_requests_in_flight_during_a_reload_match_the_version_they_are_labelled_with(
    vllm: Any, arun: Any, store: PolicyStore, tokenizer: Any, prompt_ids: list[int], pause_mode: str
) -> None:
    # generous request timeouts: on a loaded machine the long requests, and the wait-mode pause that
    # waits for them, take minutes (the client's default of 120 s would cut them)
    engine = VLLMEngine(
        vllm.ensure("raw"),
        policy_store=store.root,
        pause_mode=pause_mode,  # type: ignore[arg-type]
        timeout=600,
    )
    v1 = store.get(1)
    assert v1 is not None
    paths = {0: TINY, 1: Path(v1.path)}
    try:
        for _ in range(5):
            r = arun(reload_under_requests(engine, v1, prompt_ids, tokenizer))
            if r.aborted if pause_mode == "abort" else r.decoded_while_paused:
                break
        else:
            pytest.fail(f"no request was running when the update started, in 5 tries ({pause_mode})")
    finally:
        arun(engine.close())
    early = [t for g in r.early for t in g.trajectories]
    labels = {t.policy_version for t in early}
    # wait: the requests that ran under the pause finished on the old weights, and say so; abort:
    # they were cut and sent again once the update was done, whole, on the new weights
    assert (0 if pause_mode == "wait" else 1) in labels
    assert {t.policy_version for t in r.late.trajectories} == {1}
    for t in early + r.late.trajectories:
        assert t.finish_reason != "abort"
        ref = reference_logprobs(paths[t.policy_version], t.prompt_ids, t.completion_ids)
        assert max_diff(t.logprobs or [], ref) < ATOL, (pause_mode, t.policy_version)
    assert all(len(t.completion_ids) == 512 - len(prompt_ids) for t in early)


def _bad_checkpoints(root: Path) -> dict[str, Path]:
    trunc = root / "truncated"
    changed_checkpoint(trunc, seed=9)
    data = (trunc / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(data[:-4096])
    wide = root / "other-model"
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig.from_json_file(str(TINY / "config.json"))
    cfg.hidden_size, cfg.head_dim = 64, 16
    LlamaForCausalLM(cfg).save_pretrained(str(wide))
    empty = root / "empty"
    empty.mkdir()
    shutil.copy(TINY / "config.json", empty / "config.json")
    return {"truncated": trunc, "other-model": wide, "no-weights": empty, "missing": root / "no-such-dir"}


def test_a_bad_checkpoint_is_a_policy_load_error_and_the_old_version_stays_served(
    engine: VLLMEngine, arun: Any, store: PolicyStore, prompt_ids: list[int], tmp_path: Path
) -> None:
    v1 = store.get(1)
    assert v1 is not None
    arun(engine.load_policy(v1))
    before = _sample(arun, engine, prompt_ids)
    label = httpx.get(f"{engine.base_url}/weight_info", timeout=10).json()
    for name, path in _bad_checkpoints(tmp_path).items():
        with pytest.raises(PolicyLoadError):  # not EngineUnavailable: nothing to retry
            arun(engine.load_policy(PolicyVersion(version=7, path=str(path))))
        after = _sample(arun, engine, prompt_ids)
        assert [c.token_ids for c in after] == [c.token_ids for c in before], name
        assert [c.logprobs for c in after] == [c.logprobs for c in before], name
        assert engine.policy_version == 1
        assert httpx.get(f"{engine.base_url}/weight_info", timeout=10).json() == label
        assert httpx.get(f"{engine.base_url}/is_paused", timeout=10).json() == {"is_paused": False}


def test_a_new_client_reads_the_servers_version_instead_of_assuming_it(
    vllm: Any, arun: Any, store: PolicyStore, prompt_ids: list[int], tmp_path: Path
) -> None:
    url = vllm.ensure("raw")
    # a previous run left the server on its own version 4 (another policy store, now gone)
    old_run = PolicyStore(tmp_path / "old-run")
    v4 = old_run.publish(4, lambda d: changed_checkpoint(d, seed=4) and None)
    first = VLLMEngine(url, policy_store=old_run.root)
    arun(first.load_policy(v4))
    arun(first.close())
    shutil.rmtree(old_run.root)

    fresh = VLLMEngine(url, policy_store=store.root)
    try:
        outs = _sample(arun, fresh, prompt_ids)  # the client reloads the served model first
        assert fresh.policy_version == 0 and _matches(TINY, prompt_ids, outs) < ATOL
        v2 = store.get(2)
        assert v2 is not None
        arun(fresh.load_policy(v2))
    finally:
        arun(fresh.close())
    # a client of the same store adopts the version the server holds (its label names that record)
    same = VLLMEngine(url, policy_store=store.root)
    try:
        outs = _sample(arun, same, prompt_ids)
        assert same.policy_version == 2 and _matches(v2.path, prompt_ids, outs) < ATOL
    finally:
        arun(same.close())
    assert json.loads(httpx.get(f"{url}/weight_info", timeout=10).json()["weight_version"]) == json.loads(
        weight_label(v2)
    )


def test_after_a_500_the_next_request_on_the_kept_alive_connection_succeeds(
    engine: VLLMEngine, arun: Any, prompt_ids: list[int]
) -> None:
    async def scenario() -> tuple[int, bool, int]:
        r = await engine.http.post("/collective_rpc", json={"method": "no_such_method"})
        healthy = await engine.health()  # vLLM closed the connection the 500 came on
        outs = await engine.generate(prompt_ids, SamplingParams(max_tokens=4, seed=1))
        return r.status_code, healthy, len(outs)

    assert arun(scenario()) == (500, True, 1)


def test_an_adapter_is_refused_with_a_clear_error_when_it_is_not_an_adapter(
    engine: VLLMEngine, arun: Any, tmp_path: Path
) -> None:
    with pytest.raises(PolicyLoadError, match="No adapter found"):
        arun(engine.load_policy(PolicyVersion(version=3, path=str(tmp_path / "nothing"), kind="lora")))
