"""The environment protocol's pieces without a queue: the registry, the built-in ``countdown`` and
``python`` environments (the latter against the real sandbox in bubblewrap), the episodes one worker
holds (deadlines, raises, unknown handles), and the agent contract's validation of environments."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from pydantic import ValidationError

from env_svc.countdown import CountdownEnv
from env_svc.episodes import Episodes
from env_svc.python import PythonEnv
from env_svc.registry import REGISTRY, UnknownEnvironment, factory_of, register
from loom.clients.sandbox_session import SandboxSessionClient
from loom.contracts.envs import ENVIRONMENTS, EnvAction, EnvStepRequest, EnvTask, ToolCallBody
from loom.contracts.modes import AgentParams

FAULTY = ["tests.env.faulty"]


def _act(text: str, turn: int = 0, call: ToolCallBody | None = None) -> EnvAction:
    return EnvAction(text=text, tool_call=call, turn=turn)


def test_the_registry_serves_every_contract_name_and_only_listed_modules() -> None:
    assert set(ENVIRONMENTS) <= set(REGISTRY)
    assert factory_of("countdown", []) is CountdownEnv
    assert factory_of("tests.env.faulty:NeverDone", FAULTY).__name__ == "NeverDone"
    for name, modules in [("nope", FAULTY), ("tests.env.faulty:NeverDone", []), ("os:system", FAULTY)]:
        with pytest.raises(UnknownEnvironment):
            factory_of(name, modules)
    with pytest.raises(UnknownEnvironment, match="no environment factory"):
        factory_of("tests.env.faulty:Missing", FAULTY)
    with pytest.raises(ValueError, match="registered already"):
        register("countdown", PythonEnv)


def test_countdown_checks_each_turn_exactly_and_is_done_when_correct_or_out_of_tries() -> None:
    env = CountdownEnv()
    env.reset(EnvTask(environment="countdown", label='{"numbers": [3, 5, 7], "target": 22}'))
    wrong = env.step(_act("so \\boxed{3*5+7-1}"))  # 7-1: a number not given
    assert (wrong.reward, wrong.done, wrong.observation) == (0.0, False, "incorrect (try 1 of 3)")
    none = env.step(_act("no answer here", 1))
    assert none.reward == 0.0 and none.observation.startswith("no answer") and not none.done
    call = ToolCallBody(name="countdown_check", arguments={"expression": "3*5+7"})
    right = env.step(_act("<tool_call>...</tool_call>", 2, call))
    assert (right.reward, right.done, right.observation) == (1.0, True, "correct")
    assert right.meta["answer"] == "3*5+7"

    env.reset(EnvTask(environment="countdown", options={"numbers": [1, 2], "target": 3, "max_tries": 1}))
    last = env.step(_act("\\boxed{2-1}"))
    assert last.done and last.reward == 0.0
    with pytest.raises(ValueError, match="needs numbers and target"):
        env.reset(EnvTask(environment="countdown", label="not json"))
    with pytest.raises(ValidationError):
        env.reset(EnvTask(environment="countdown", options={"numbers": [1], "target": 1, "max_tries": 0}))


def test_python_keeps_state_across_cells_in_the_real_sandbox(sandbox_url: str) -> None:
    env = PythonEnv(SandboxSessionClient(sandbox_url, busy_wait_s=5))
    try:
        assert env.reset(EnvTask(environment="python")).status == "ok"
        first = env.step(_act("", 0, ToolCallBody(name="python", arguments={"code": "x = 41 + 1"})))
        assert first.observation == "[ok]" and first.meta["sandbox_status"] == "ok"
        second = env.step(_act("", 1, ToolCallBody(name="python", arguments={"code": "print(x)"})))
        assert second.observation == "[ok]\n42" and not second.done
        error = env.step(_act("", 2, ToolCallBody(name="python", arguments={"code": "1/0"})))
        assert error.observation.startswith("[runtime_error]") and "ZeroDivisionError" in error.observation
        bad = env.step(_act("", 3, ToolCallBody(name="shell", arguments={"code": "ls"})))
        assert bad.meta["sandbox_status"] == "bad_call" and not bad.done
        assert env.step(_act("the answer is 42", 4)).done  # a turn without a call is the answer
        session = env.session
        assert session is not None
        env.session.close()  # the sandbox forgets the session: the next cell is a typed observation
        lost = env.step(_act("", 5, ToolCallBody(name="python", arguments={"code": "print(x)"})))
        assert lost.observation.startswith("[session_lost]") and lost.meta["alive"] is False
    finally:
        env.close()


def test_python_without_a_sandbox_is_a_typed_reset() -> None:
    env = PythonEnv(SandboxSessionClient("http://127.0.0.1:9", busy_wait_s=0, retries=0))
    reset = env.reset(EnvTask(environment="python"))
    assert reset.status == "env_error" and "no sandbox session" in (reset.error or "")
    env.close()


def test_episodes_answer_every_failure_with_its_status(tmp_path: Path) -> None:
    eps = Episodes(FAULTY, idle_s=600, open_timeout_s=5)
    try:
        assert eps.open(EnvTask(environment="nope"), "q").reset.status == "unknown_env"
        broken = eps.open(EnvTask(environment="tests.env.faulty:RaisesOnReset"), "q")
        assert broken.reset.status == "env_error" and not broken.handle
        raises = eps.open(EnvTask(environment="tests.env.faulty:Raises"), "q")
        step = eps.step(EnvStepRequest(handle=raises.handle, action=_act("a"), timeout_s=5))
        assert step.status == "env_error" and "RuntimeError: broken at turn 0" in step.observation
        hangs = eps.open(EnvTask(environment="tests.env.faulty:Hangs", options={"sleep_s": 2}), "q")
        assert (hangs.queue, len(eps)) == ("q", 2)
        ok = eps.step(EnvStepRequest(handle=hangs.handle, action=_act("a", 0), timeout_s=5))
        assert ok.status == "ok"
        late = eps.step(EnvStepRequest(handle=hangs.handle, action=_act("a", 1), timeout_s=0.2))
        assert late.status == "timeout" and "timed out after 0.2 s" in late.observation
        busy = eps.step(EnvStepRequest(handle=hangs.handle, action=_act("a", 2), timeout_s=0.2))
        assert busy.status == "timeout" and "its last step still runs" in busy.observation
        assert eps.end(hangs.handle) and not eps.end(hangs.handle)
        gone = eps.step(EnvStepRequest(handle=hangs.handle, action=_act("a", 3), timeout_s=1))
        assert gone.status == "env_lost"
    finally:
        eps.close()


def test_idle_episodes_are_reaped_and_closed() -> None:
    eps = Episodes(FAULTY, idle_s=0.05, open_timeout_s=5)
    closed = threading.Event()
    try:
        opened = eps.open(EnvTask(environment="countdown", options={"numbers": [1], "target": 1}), "q")
        eps._held[opened.handle].env.close = closed.set  # type: ignore[method-assign]
        threading.Event().wait(0.1)
        assert eps.reap() == 1 and closed.wait(5) and len(eps) == 0
    finally:
        eps.close()


def test_the_agent_contract_names_known_environments_only() -> None:
    assert AgentParams(environment="countdown", env_options={"max_tries": 2}).environment == "countdown"
    for bad in ({"environment": "nope"}, {"env_options": {"a": 1}}, {"environment": "os:system"}):
        with pytest.raises(ValidationError):
            AgentParams(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="env_options longer"):
        AgentParams(environment="countdown", env_options={"x": "y" * 70_000})
