"""verl's side of tests/interop_rollout/test_verl_rollout.py, run by it in the verl side interpreter
(.venv/side-verl: hydra-core, omegaconf and the ANTLR 4.9 runtime ahead of the main venv; made by
deploy/setup.sh; docs/interop-rollout.md, "verl"), against a Loom stack that test started on the main
venv's python (its reward worker needs math-verify's ANTLR 4.13.2). The stack's gateway URL comes in
``LOOM_VERL_STACK_URL``. Not collected in the main run (no ``test_`` prefix).

verl 0.9.1's own agent-loop rollout (``AgentLoopWorker.generate_sequences``, verl/experimental/
agent_loop/agent_loop.py) driving ``LoomAgentLoop`` (loom/clients/verl_rollout.py) against a live Loom
deployment, in plain, streaming, tree and spawn mode. verl's config is its own ``ppo_trainer``
composed by hydra, the agent loop named in it through ``agent_loop_config_path``; the batch is
repeated ``rollout.n`` times per prompt as verl's trainer does (``DataProto.repeat(interleave=True)``,
one ``uid`` per prompt). What comes back is verl's padded batch: its shapes, response mask, rollout
log-probs (equal to a teacher-forced pass of the served weights, 1e-4), rewards (verl's
``extract_reward``) and GRPO advantages (verl's ``compute_grpo_outcome_advantage``) are checked."""

from __future__ import annotations

import asyncio
import os
import sys
import sysconfig
from importlib.metadata import version
from pathlib import Path
from typing import Any

import antlr4
import hydra
import numpy as np
import pytest
import torch
import verl
import yaml
from hydra import compose, initialize_config_dir
from verl import DataProto
from verl.experimental.agent_loop import AgentLoopWorker
from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage, compute_policy_loss_vanilla
from verl.trainer.ppo.reward import extract_reward
from verl.utils.config import omega_conf_to_dataclass

import loom
from loom.clients.policies import PolicyPublisher
from loom.clients.verl_rollout import LoomAgentLoop
from tests.interop_rollout.loom_stack import TRAINER, TRAINER_KEY
from tests.interop_rollout.test_client import teacher_forced
from zoo.tiny import (
    CHECKPOINT_DIR,
    STREAM_HEADER,
    load_model,
    load_tokenizer,
    make_problems,
    plain_prompt,
    spawn_prompt,
)
from zoo.tiny.traces import stream_sentences

STACK_URL_ENV = "LOOM_VERL_STACK_URL"

pytestmark = pytest.mark.slow

PROMPT_LEN = 64
TREE = {"strategy": "random", "branches": 1, "continuations": 2, "min_distance": 4}


@pytest.fixture(scope="module")
def stack_url() -> str:
    """The gateway of the Loom stack test_verl_rollout.py started on the main venv's python."""
    url = os.environ.get(STACK_URL_ENV)
    if not url:
        pytest.fail(
            f"{STACK_URL_ENV} is not set: run this module through tests/interop_rollout/test_verl_rollout.py"
        )
    return url


@pytest.fixture(scope="module")
def model() -> Any:
    torch.set_num_threads(1)
    return load_model().eval()


def worker(url: str, tmp: Path, n: int, agent: str, response_len: int = 160, **loop: Any) -> AgentLoopWorker:
    """verl's AgentLoopWorker from its own ppo_trainer config, with a Loom agent loop named ``agent``
    in ``agent_loop_config_path`` (the keys after ``_target_`` reach ``LoomAgentLoop``)."""
    entry = {"name": agent, "_target_": "loom.clients.verl_rollout.LoomAgentLoop", "url": url} | loop
    path = tmp / "loom_agent.yaml"
    path.write_text(yaml.safe_dump([entry]))
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(
            config_name="ppo_trainer",
            overrides=[
                f"actor_rollout_ref.model.path={CHECKPOINT_DIR}",
                "actor_rollout_ref.rollout.name=vllm",  # mandatory in verl's config; no server is used
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",  # its actor config's own check
                f"actor_rollout_ref.rollout.prompt_length={PROMPT_LEN}",
                f"actor_rollout_ref.rollout.response_length={response_len}",
                f"actor_rollout_ref.rollout.n={n}",
                "actor_rollout_ref.rollout.temperature=1.0",
                f"actor_rollout_ref.rollout.agent.default_agent_loop={agent}",
                f"actor_rollout_ref.rollout.agent.agent_loop_config_path={path}",
            ],
        )
    return AgentLoopWorker(cfg, llm_client=None)


def rollout(w: AgentLoopWorker, rows: list[dict[str, Any]], n: int, step: int = 1) -> DataProto:
    """What verl's trainer hands its agent loop workers: one uid per prompt, repeated n times in a row."""
    batch = DataProto.from_dict(
        non_tensors={
            "raw_prompt": np.array([r["prompt"] for r in rows], dtype=object),
            "reward_model": np.array(
                [{"ground_truth": r["label"], "style": "rule"} for r in rows], dtype=object
            ),
            "extra_info": np.array(
                [{"index": i, "loom": r.get("loom", {})} for i, r in enumerate(rows)], dtype=object
            ),
            "data_source": np.array(["arith"] * len(rows), dtype=object),
            "uid": np.array([f"uid-{i}" for i in range(len(rows))], dtype=object),
        },
        meta_info={"global_steps": step},
    )
    gen = batch.repeat(repeat_times=n, interleave=True)
    return asyncio.run(w.generate_sequences(gen))


def check_batch(out: DataProto, model: Any, rows: int, w: AgentLoopWorker) -> list[dict[str, Any]]:
    """verl's padded batch, unpadded per row and checked token-exact against the served weights; then
    verl's reward extraction, GRPO advantages and PPO loss on it."""
    out.check_consistency()
    b = out.batch
    response_len = int(w.rollout_config.response_length)
    recomputed = torch.zeros(rows, response_len)  # what verl's actor would compute on the same weights
    assert b["prompts"].shape == (rows, PROMPT_LEN) and b["responses"].shape == (rows, response_len)
    assert (
        b["input_ids"].shape
        == b["attention_mask"].shape
        == b["position_ids"].shape
        == (rows, PROMPT_LEN + response_len)
    )
    assert b["response_mask"].shape == b["rollout_log_probs"].shape == (rows, response_len)
    nt = out.non_tensor_batch
    unpadded = []
    for i in range(rows):
        attn = b["attention_mask"][i]
        prompt = b["prompts"][i][attn[:PROMPT_LEN].bool()].tolist()
        length = int(attn[PROMPT_LEN:].sum())
        response = b["responses"][i][:length].tolist()
        mask = b["response_mask"][i].tolist()
        logp = b["rollout_log_probs"][i].tolist()
        assert not any(mask[length:]) and not any(logp[length:])  # padding: neither trained nor scored
        assert nt["loom_truncated"][i] is False
        ref = teacher_forced(model, prompt, response)
        recomputed[i, :length] = torch.tensor(ref)
        trained = [j for j in range(length) if mask[j]]
        assert trained
        assert [logp[j] for j in trained] == pytest.approx([ref[j] for j in trained], abs=1e-4)
        env = nt["loom_env_mask"][i]
        assert len(env) == length and all(env[j] for j in trained)
        unpadded.append({"prompt": prompt, "response": response, "mask": mask[:length], "env": env})
    # the job's reward is verl's rm_scores (one score on the last response token) and reaches GRPO
    reward, _ = extract_reward(out)
    assert reward.sum(-1).tolist() == pytest.approx([float(r) for r in nt["loom_reward"]])
    # GRPO as verl's trainer calls it (ray_trainer.py, compute_advantage: importing ray_trainer needs
    # torchdata, which verl's rollout path does not), grouping by uid
    adv, _ = compute_grpo_outcome_advantage(
        token_level_rewards=reward, response_mask=b["response_mask"], index=nt["uid"]
    )
    assert adv.shape == (rows, response_len)
    assert torch.all(adv[b["response_mask"] == 0] == 0)  # inserted tokens and padding get no advantage
    # verl's PPO loss with Loom's behaviour log-probs as the old policy: the ratio is 1 on every trained token
    _, metrics = compute_policy_loss_vanilla(
        old_log_prob=b["rollout_log_probs"],
        log_prob=recomputed,
        advantages=adv,
        response_mask=b["response_mask"],
        config=omega_conf_to_dataclass(w.config.actor_rollout_ref.actor),
    )
    assert abs(float(metrics["actor/ppo_kl"])) < 1e-4 and float(metrics["actor/pg_clipfrac"]) == 0.0
    return unpadded


def test_side_interpreter_has_antlr_4_9_ahead_of_the_main_venv() -> None:
    """hydra's ANTLR 4.9 comes from the side venv, everything else from the main venv after it."""
    side = Path(sysconfig.get_paths()["purelib"])
    main = Path(verl.__file__).parents[1]
    assert version("antlr4-python3-runtime").startswith("4.9."), version("antlr4-python3-runtime")
    for mod in (antlr4, hydra):
        assert Path(mod.__file__ or "").is_relative_to(side), mod.__file__
    for mod in (torch, verl):
        where = Path(mod.__file__ or "")
        assert where.is_relative_to(main) and not where.is_relative_to(side), where
    assert sys.path.index(str(side)) < sys.path.index(str(main))
    assert Path(loom.__file__ or "").parents[1] == Path(__file__).resolve().parents[2]  # this checkout's loom


def test_loom_agent_loop_is_registered_under_its_name() -> None:
    assert _agent_loop_registry["loom"] == {"_target_": "loom.clients.verl_rollout.LoomAgentLoop"}
    assert issubclass(LoomAgentLoop, verl.experimental.agent_loop.AgentLoopBase)


def test_plain_rows_of_one_uid_are_one_loom_group_at_the_version_named(
    stack_url: str, model: Any, tmp_path: Path
) -> None:
    problems = make_problems("arith", 2, seed=41)
    rows = [{"prompt": plain_prompt(p), "label": p.gold, "loom": {"task": "arithmetic"}} for p in problems]
    w = worker(
        stack_url,
        tmp_path,
        3,
        "loom_plain",
        api_key=TRAINER_KEY,
        sampling={"max_tokens": 48},
        policy_version=0,
        policy_namespace=TRAINER,
        policy_match="exact",
    )
    out = rollout(w, rows, n=3)
    unpadded = check_batch(out, model, 6, w)
    nt = out.non_tensor_batch
    tok = load_tokenizer()
    for i, u in enumerate(unpadded):
        assert tok.decode(u["prompt"]) == rows[i // 3]["prompt"] and all(u["mask"])
    assert list(nt["uid"]) == [f"uid-{i // 3}" for i in range(6)]
    groups = list(nt["loom_group_id"])
    assert groups[0] == groups[1] == groups[2] != groups[3] == groups[4] == groups[5]
    assert len(set(nt["loom_trajectory_id"])) == 6
    # version 0 is the deployment's base model in every namespace (recorded without one)
    assert set(nt["loom_policy_version"]) == {0} and set(nt["loom_policy_namespace"]) == {None}


def test_streaming_inserted_sentences_are_out_of_the_response_mask_at_the_latest_version(
    stack_url: str, model: Any, tmp_path: Path
) -> None:
    # the trainer publishes its weights (perturbed: another policy than the base) as version 1
    trained = load_model().eval()
    with torch.no_grad():
        torch.manual_seed(0)
        trained.lm_head.weight.add_(0.05 * torch.randn_like(trained.lm_head.weight))
    with PolicyPublisher(stack_url, TRAINER_KEY) as publisher:
        ref = publisher.publish_model(trained, load_tokenizer(), version=1)
    assert (ref.namespace, ref.version) == (TRAINER, 1)

    problems = make_problems("arith", 2, seed=43)
    rows = [
        {
            "prompt": p.text,  # verl's raw prompt; Loom streams the problem's sentences after its header
            "label": p.gold,
            "loom": {
                "prompt": STREAM_HEADER,
                "task": "arithmetic",
                "mode_params": {"sentences": stream_sentences(p), "segment_cap": 32, "answer_max_tokens": 16},
            },
        }
        for p in problems
    ]
    # verl's response window holds the longest streaming response: the inserted sentences (36 tokens
    # and their markers here), four thoughts of at most segment_cap, the deep phase's max_tokens and
    # the answer's (about 290); at 160 a perturbed policy sampled at temperature 1 overran it now and then
    w = worker(
        stack_url,
        tmp_path,
        2,
        "loom_streaming",
        response_len=320,
        api_key=TRAINER_KEY,
        mode="streaming",
        sampling={"max_tokens": 96},
        policy_version="latest",
    )
    out = rollout(w, rows, n=2)
    unpadded = check_batch(out, trained, 4, w)  # the published weights' log-probs, not the base model's
    nt = out.non_tensor_batch
    assert set(nt["loom_policy_version"]) == {1} and set(nt["loom_policy_namespace"]) == {TRAINER}
    tok = load_tokenizer()
    for u in unpadded:
        assert tok.decode(u["prompt"]) == STREAM_HEADER
        assert 0 in u["mask"] and 1 in u["mask"]
        inserted = tok.decode([t for t, m in zip(u["response"], u["env"], strict=True) if not m])
        assert "number is" in inserted  # the revealed sentences: in the response, never trained
        assert all(not m for m, e in zip(u["mask"], u["env"], strict=True) if not e)
    # a teacher-forced pass of the base model is not what served them
    base = teacher_forced(model, unpadded[0]["prompt"], unpadded[0]["response"])
    logp = out.batch["rollout_log_probs"][0].tolist()
    assert max(abs(logp[j] - base[j]) for j, m in enumerate(unpadded[0]["mask"]) if m) > 1e-3


def test_tree_leaves_fill_the_rows_with_treerl_advantages_beside_them(
    stack_url: str, model: Any, tmp_path: Path
) -> None:
    problems = make_problems("arith", 2, seed=45)
    rows = [{"prompt": plain_prompt(p), "label": p.gold, "loom": {"task": "arithmetic"}} for p in problems]
    w = worker(
        stack_url,
        tmp_path,
        4,
        "loom_tree",
        api_key=TRAINER_KEY,
        mode="tree",
        mode_params=TREE,
        sampling={"max_tokens": 48},
        policy_version=0,
    )
    out = rollout(w, rows, n=4)
    unpadded = check_batch(out, model, 8, w)
    nt = out.non_tensor_batch
    assert ".b" in "".join(nt["loom_trajectory_id"]), "no branch leaf reached verl"
    assert len(set(nt["loom_trajectory_id"])) == 8
    for i, u in enumerate(unpadded):
        adv = nt["loom_advantages"][i]
        assert adv is not None and len(adv) == len(u["response"])
        assert all(a == 0.0 for a, m in zip(adv, u["mask"], strict=True) if not m)
    assert set(nt["loom_policy_version"]) == {0}


def test_spawn_roots_fill_the_rows_with_the_join_blocks_masked(
    stack_url: str, model: Any, tmp_path: Path
) -> None:
    problems = make_problems("countdown", 2, seed=3)
    rows = [
        {
            "prompt": spawn_prompt(p),
            "label": {"numbers": list(p.numbers), "target": p.target},  # as a parquet row holds it
            "loom": {"task": "countdown"},
        }
        for p in problems
    ]
    w = worker(
        stack_url,
        tmp_path,
        2,
        "loom_spawn",
        response_len=256,
        api_key=TRAINER_KEY,
        mode="spawn",
        sampling={"max_tokens": 200},
    )
    out = rollout(w, rows, n=2)
    unpadded = check_batch(out, model, 4, w)
    nt = out.non_tensor_batch
    assert len(set(nt["loom_trajectory_id"])) == 4
    joined = [u for u in unpadded if 0 in u["env"]]
    assert joined, "no parent joined its children"
    for u in joined:  # the join block was inserted, not sampled: never trained
        assert all(not m for m, e in zip(u["mask"], u["env"], strict=True) if not e)


def test_config_that_cannot_hold_is_refused_before_any_job(tmp_path: Path) -> None:
    """Nothing listens on port 9: a refusal that came after a request would be a connection error."""
    rows = [{"prompt": "[plain] Compute 1+2.\n", "label": "3"}]
    bad_version = worker("http://127.0.0.1:9", tmp_path, 2, "loom_bad", policy_version="newest")
    with pytest.raises(Exception, match="policy_version must be an int, 'latest' or null"):
        rollout(bad_version, rows, n=2)
    few = worker("http://127.0.0.1:9", tmp_path, 2, "loom_few", mode="tree", mode_params={"initial": 1})
    with pytest.raises(ValueError, match=r"initial=1 < rollout.n=2: too few leaves"):
        rollout(few, rows, n=2)
    layout = worker(
        "http://127.0.0.1:9",
        tmp_path,
        2,
        "loom_layout",
        mode="streaming",
        mode_params={"layout": "group_positions"},
    )
    with pytest.raises(Exception, match="group_positions' has no verl form"):
        rollout(layout, rows, n=2)
