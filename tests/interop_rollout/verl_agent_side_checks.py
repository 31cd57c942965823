"""verl's side of tests/interop_rollout/test_verl_agent_seam.py, run by it in the verl side interpreter
(.venv/side-verl, as verl_side_checks.py is; docs/interop-rollout.md, "Agent mode at each trainer's
seam"), against the Loom stack that test started (``LOOM_VERL_STACK_URL``) serving
tests/interop_rollout/agent_model.py's checkpoint (``LOOM_VERL_AGENT_CHECKPOINT``). Not collected in
the main run (no ``test_`` prefix).

verl 0.9.1's own ``AgentLoopWorker.generate_sequences``, from its ``ppo_trainer`` config composed by
hydra, runs ``LoomToolAgentLoop`` (registered ``loom_tool_agent``; loom/clients/verl_rollout.py) named
in ``agent_loop_config_path``, with verl's ``rollout.multi_turn`` settings. What comes back is verl's
padded batch: each row unpadded is checked against Loom's stored episode (token-exact ids, the
response mask 0 exactly on the tool responses, the rollout log-probs equal to a teacher-forced pass
of the served weights at 1e-4: tests/interop_rollout/agent_checks.py), and verl's GRPO advantage and
PPO loss run on it (verl_side_checks.py's ``check_batch``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import verl
import yaml
from hydra import compose, initialize_config_dir
from transformers import AutoModelForCausalLM, AutoTokenizer
from verl.experimental.agent_loop import AgentLoopWorker
from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

from loom.clients.verl_rollout import LoomToolAgentLoop
from tests.interop_rollout.agent_checks import AGENT, LABEL, PROMPTS, check_episode, loom_trajectory
from tests.interop_rollout.loom_stack import TRAINER_KEY
from tests.interop_rollout.verl_side_checks import PROMPT_LEN, check_batch, rollout

STACK_URL_ENV = "LOOM_VERL_STACK_URL"
CHECKPOINT_ENV = "LOOM_VERL_AGENT_CHECKPOINT"
RESPONSE_LEN = 48

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack_url() -> str:
    url = os.environ.get(STACK_URL_ENV)
    if not url:
        pytest.fail(f"{STACK_URL_ENV} is not set: run this module through test_verl_agent_seam.py")
    return url


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    return Path(os.environ[CHECKPOINT_ENV])


@pytest.fixture(scope="module")
def model(checkpoint: Path) -> Any:
    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(checkpoint).eval()


def worker(url: str, checkpoint: Path, tmp: Path, n: int, max_turns: int, **loop: Any) -> AgentLoopWorker:
    """verl's AgentLoopWorker from its own ppo_trainer config with multi_turn on, the Loom tool agent
    loop named in ``agent_loop_config_path``."""
    entry = {
        "name": "loom_tools",
        "_target_": "loom.clients.verl_rollout.LoomToolAgentLoop",
        "url": url,
    } | loop
    path = tmp / "loom_agent.yaml"
    path.write_text(yaml.safe_dump([entry]))
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(
            config_name="ppo_trainer",
            overrides=[
                f"actor_rollout_ref.model.path={checkpoint}",
                "actor_rollout_ref.rollout.name=vllm",  # mandatory in verl's config; no server is used
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                f"actor_rollout_ref.rollout.prompt_length={PROMPT_LEN}",
                f"actor_rollout_ref.rollout.response_length={RESPONSE_LEN}",
                f"actor_rollout_ref.rollout.n={n}",
                "actor_rollout_ref.rollout.temperature=1.0",
                "actor_rollout_ref.rollout.multi_turn.enable=true",
                f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={max_turns}",
                "actor_rollout_ref.rollout.agent.default_agent_loop=loom_tools",
                f"actor_rollout_ref.rollout.agent.agent_loop_config_path={path}",
            ],
        )
    return AgentLoopWorker(cfg, llm_client=None)


def test_loom_tool_agent_loop_is_registered_under_its_name() -> None:
    assert _agent_loop_registry["loom_tool_agent"] == {
        "_target_": "loom.clients.verl_rollout.LoomToolAgentLoop"
    }
    assert issubclass(LoomToolAgentLoop, verl.experimental.agent_loop.AgentLoopBase)


def test_tool_agent_rows_are_loom_episodes_token_exact(
    stack_url: str, checkpoint: Path, model: Any, tmp_path: Path
) -> None:
    n = 2
    params = {k: v for k, v in AGENT.items() if k != "max_turns"}  # verl's max_assistant_turns gives it
    w = worker(
        stack_url, checkpoint, tmp_path, n, 3, api_key=TRAINER_KEY, mode_params=params, sampling={"seed": 7}
    )
    rows = [{"prompt": p, "label": LABEL, "loom": {"task": "arithmetic"}} for p in PROMPTS]
    out = rollout(w, rows, n=n)
    unpadded = check_batch(out, model, len(rows) * n, w)
    nt = out.non_tensor_batch
    tok = AutoTokenizer.from_pretrained(checkpoint)
    observed = 0
    for i, u in enumerate(unpadded):
        t = loom_trajectory(stack_url, TRAINER_KEY, nt["loom_group_id"][i], nt["loom_trajectory_id"][i])
        length = len(u["response"])
        logp = out.batch["rollout_log_probs"][i].tolist()[:length]
        got = check_episode(t, tok, model, u["prompt"], u["response"], u["mask"], logp)
        observed += got
        turns = sum(1 for s in t.segments if s.kind == "turn")
        assert turns <= 3  # verl's max_assistant_turns became the episode's max_turns
        assert int(nt["__num_turns__"][i]) == 1 + turns + got  # verl's count: prompt, turns, tool responses
        assert nt["loom_tool_calls"][i] == got and nt["loom_stop_reason"][i] == t.stop_reason
    assert observed > 0, "no episode called the calculator"


def test_verl_tools_that_loom_cannot_run_are_refused(checkpoint: Path, tmp_path: Path) -> None:
    from loom.clients.trainer_rows import loom_tools

    class Tool:  # what verl's tool list holds: objects with a name (verl's BaseTool)
        def __init__(self, name: str) -> None:
            self.name = name

    assert loom_tools([Tool("calculator")], "verl") == ["calculator"]
    with pytest.raises(ValueError, match=r"verl's tools \['search'\] are not Loom's built-in tools"):
        loom_tools([Tool("search")], "verl")
    w = worker("http://127.0.0.1:9", checkpoint, tmp_path, 2, 3, mode="plain")
    with pytest.raises(Exception, match="LoomToolAgentLoop runs Loom's agent mode, not 'plain'"):
        rollout(w, [{"prompt": PROMPTS[0], "label": LABEL}], n=2)
