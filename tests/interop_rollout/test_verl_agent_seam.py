"""verl 0.9.1's own agent-loop rollout driving ``LoomToolAgentLoop`` (loom/clients/verl_rollout.py) in
Loom's agent mode, across two interpreters as tests/interop_rollout/test_verl_rollout.py runs verl
(docs/interop-rollout.md, "Agent mode at each trainer's seam"): the Loom stack (gateway, rollout and
reward workers) here on the main venv's python, serving tests/interop_rollout/agent_model.py's
checkpoint (the built-in models call no tool), and verl's side (hydra compose, ``AgentLoopWorker``,
every check on its batch) in ``.venv/side-verl``: tests/interop_rollout/verl_agent_side_checks.py.
Each check there is a test here, passing only where it passed in the side run's JUnit XML."""

from __future__ import annotations

import ast
import os
import subprocess
from pathlib import Path

import pytest

from tests.interop_rollout.agent_model import build_agent_model
from tests.interop_rollout.loom_stack import LoomStack
from tests.interop_rollout.test_verl_rollout import REPO, SIDE_PYTHON, SideRun, junit_results

SIDE_CHECKS = Path(__file__).with_name("verl_agent_side_checks.py")
SIDE_TIMEOUT_S = 1200
INNER = [
    node.name
    for node in ast.parse(SIDE_CHECKS.read_text()).body
    if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(SIDE_TIMEOUT_S + 600)]


@pytest.fixture(scope="module")
def side_run(tmp_path_factory: pytest.TempPathFactory) -> SideRun:
    tmp = tmp_path_factory.mktemp("verl-agent")
    checkpoint = build_agent_model(tmp / "agent-model")
    with LoomStack(tmp, extra_env={"LOOM_MODEL": str(checkpoint)}) as stack:
        xml = tmp / "side-junit.xml"
        argv = [str(SIDE_PYTHON), "-m", "pytest", "-q", str(SIDE_CHECKS), f"--junitxml={xml}"]
        argv += [f"--basetemp={tmp / 'side-tmp'}", "-p", "no:cacheprovider"]
        env = os.environ | {
            "LOOM_VERL_STACK_URL": stack.url,
            "LOOM_VERL_AGENT_CHECKPOINT": str(checkpoint),
            "OMP_NUM_THREADS": "1",
        }
        env.pop("PYTEST_ADDOPTS", None)
        proc = subprocess.run(
            argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=SIDE_TIMEOUT_S
        )
        output = proc.stdout.decode(errors="replace")
        assert xml.is_file(), f"the side run wrote no JUnit XML (rc {proc.returncode}):\n{output[-6000:]}"
        results = junit_results(xml)
        logs = stack.logs() if proc.returncode != 0 else ""
    return SideRun(proc.returncode, results, output, logs)


def test_the_side_run_ran_every_check_and_passed(side_run: SideRun) -> None:
    assert sorted(side_run.results) == sorted(INNER), side_run.output[-6000:]
    assert side_run.returncode == 0, side_run.output[-6000:] + "\n" + side_run.stack_logs


@pytest.mark.parametrize("name", INNER)
def test_verl_agent_side_check(side_run: SideRun, name: str) -> None:
    assert name in side_run.results, f"{name} did not run in the side interpreter:\n{side_run.output[-4000:]}"
    outcome, message = side_run.results[name]
    if outcome != "passed":
        pytest.fail(f"{name} {outcome} in the side interpreter:\n{message}\n-----\n{side_run.stack_logs}")
