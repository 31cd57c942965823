"""verl 0.9.1's own agent-loop rollout driving ``LoomAgentLoop`` (loom/clients/verl_rollout.py) against
a live Loom deployment, run across two interpreters (issue 34; docs/interop-rollout.md, "verl").

verl's agent loop imports hydra, and hydra-core 1.3's generated grammar needs the ANTLR 4.9 runtime,
while math-verify's LaTeX parser needs 4.13.2 (with 4.9 it scores a gold ``10\\%`` against
``\\boxed{10}`` as wrong: tests/reward/test_pool.py). So the Loom stack (gateway, rollout and reward
workers: tests/interop_rollout/loom_stack.py) runs here, on the main venv's python with 4.13.2, and
verl's side (hydra compose, ``AgentLoopWorker``, every check on its batch) runs in the side
interpreter deploy/setup.sh makes, ``<main venv>/side-verl`` (hydra-core, omegaconf and ANTLR 4.9
ahead of the main venv's site-packages): ``python -m pytest`` on tests/interop_rollout/
verl_side_checks.py, against this stack's gateway (``LOOM_VERL_STACK_URL``). Each check there is a
test here, passing only where it passed in the side run's JUnit XML (its failure message otherwise)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import pytest

from tests.interop_rollout.loom_stack import LoomStack

SIDE_PYTHON = Path(sys.prefix) / "side-verl" / "bin" / "python"
SIDE_CHECKS = Path(__file__).with_name("verl_side_checks.py")
REPO = Path(__file__).resolve().parents[2]
SIDE_TIMEOUT_S = 2400  # the side run, all its checks (a loaded 2-core machine)
INNER = [
    node.name
    for node in ast.parse(SIDE_CHECKS.read_text()).body
    if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(SIDE_TIMEOUT_S + 600)]

if not SIDE_PYTHON.is_file():
    pytest.skip(
        f"no verl side interpreter at {SIDE_PYTHON} (hydra-core 1.3 + ANTLR 4.9, which cannot share this "
        "venv with math-verify's ANTLR 4.13.2): `bash deploy/setup.sh` makes it where the package "
        "registry has hydra-core, omegaconf 2.3 and antlr4-python3-runtime 4.9",
        allow_module_level=True,
    )


@dataclass
class SideRun:
    returncode: int
    results: dict[str, tuple[str, str]]  # test name -> (outcome, message)
    output: str
    stack_logs: str


def junit_results(path: Path) -> dict[str, tuple[str, str]]:
    results: dict[str, tuple[str, str]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            el = case.find(kind)
            if el is not None:
                outcome = kind
                message = (el.get("message") or "") + "\n" + (el.text or "")
                break
        results[case.get("name", "")] = (outcome, message.strip())
    return results


@pytest.fixture(scope="module")
def side_run(tmp_path_factory: pytest.TempPathFactory) -> SideRun:
    # this interpreter is the main venv's, with math-verify's ANTLR 4.13.2
    assert version("antlr4-python3-runtime").startswith("4.13."), version("antlr4-python3-runtime")
    tmp = tmp_path_factory.mktemp("verl-rollouts")
    with LoomStack(tmp) as stack:
        # every service of the stack runs on the main venv's python (the reward worker's ANTLR 4.13.2)
        assert stack.gateway is not None and stack.gateway.proc is not None
        for proc in [w.proc for w in stack.workers] + [stack.gateway.proc]:
            assert proc.args[0] == sys.executable, proc.args
        xml = tmp / "side-junit.xml"
        argv = [str(SIDE_PYTHON), "-m", "pytest", "-q", str(SIDE_CHECKS), f"--junitxml={xml}"]
        argv += [f"--basetemp={tmp / 'side-tmp'}", "-p", "no:cacheprovider"]
        env = os.environ | {"LOOM_VERL_STACK_URL": stack.url, "OMP_NUM_THREADS": "1"}
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
def test_verl_side_check(side_run: SideRun, name: str) -> None:
    assert name in side_run.results, f"{name} did not run in the side interpreter:\n{side_run.output[-4000:]}"
    outcome, message = side_run.results[name]
    if outcome != "passed":
        pytest.fail(f"{name} {outcome} in the side interpreter:\n{message}\n-----\n{side_run.stack_logs}")
