"""Code rewards: the policy's last fenced block run per test in the real sandbox service (over HTTP
on 127.0.0.1), scored as ``code_pass`` / ``code_all`` / a code task's ``accuracy``, through Loom's own
route and the trainers' protocols (OpenRLHF, slime, TRL's reward function, verl's reward function)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from loom.contracts.rewards import CodeParams
from reward_svc.code import CodeTests, CodeVerdict, extract_program, plan_runs, read_tests
from tests.reflect.reflect_helpers import serve
from tests.sandbox.conftest import sandbox_url  # noqa: F401  (the fixture)

TESTS = json.dumps({"inputs": ["1 2\n", "5 7\n", "10 -3\n", "0 0\n"], "outputs": ["3", "12", "7", "0"]})
RIGHT = "Sum them.\n```python\na, b = map(int, input().split())\nprint(a + b)\n```\nDone."
HALF = "```python\na, b = map(int, input().split())\nprint(a + b if a < 10 else -1)\n```"
HANG = "```python\nwhile True:\n    pass\n```"
BOMB = "```python\nimport os\nwhile True:\n    os.fork()\n```"
NOCODE = "the answer is a + b"
COMPONENTS = [{"name": "code_pass", "params": {"timeout_s": 1}}, {"name": "code_all"}, {"name": "accuracy"}]


@pytest.fixture(scope="module")
def reward_url(sandbox_url: str) -> Iterator[str]:  # noqa: F811
    mp = pytest.MonkeyPatch()
    mp.setenv("LOOM_REWARD_SANDBOX_URL", sandbox_url)
    from loom.contracts.reward_settings import get_reward_settings
    from reward_svc import api, tasks

    get_reward_settings.cache_clear()
    tasks._client = None
    try:
        with serve(api.app) as url:
            yield url
    finally:
        tasks._client = None
        get_reward_settings.cache_clear()
        mp.undo()


def test_the_program_is_the_last_fenced_block() -> None:
    assert extract_program("```py\nx=1\n```\ntext\n```bash\necho hi\n```") == ("bash", "echo hi\n")
    assert extract_program("no code") is None


def test_tests_are_read_from_each_label_form() -> None:
    io = read_tests(json.dumps({"tests": [{"stdin": "1", "stdout": "2"}]}))
    assert isinstance(io, CodeTests) and io.stdin == ["1"] and io.stdout == ["2"]
    asserts = read_tests(json.dumps({"assert_case": ["assert f(1) == 2"]}))
    assert isinstance(asserts, CodeTests) and asserts.asserts == ["assert f(1) == 2"]
    for bad in (None, "not json", "[1]", json.dumps({"inputs": ["1"], "outputs": []})):
        assert isinstance(read_tests(bad), CodeVerdict) and read_tests(bad).status == "invalid"  # type: ignore[union-attr]
    runs = plan_runs(asserts, "```python\ndef f(x):\n    return x + 1\n```", CodeParams())
    assert isinstance(runs, list) and runs[0].code.endswith("assert f(1) == 2\n")


def test_code_rewards_score_each_program_by_its_tests(reward_url: str) -> None:
    texts = [RIGHT, HALF, HANG, BOMB, NOCODE]
    group = {
        "id": "g",
        "task": "code",
        "label": TESTS,
        "trajectories": [{"id": f"t{i}", "group_id": "g", "text": t} for i, t in enumerate(texts)],
    }
    r = httpx.post(
        f"{reward_url}/v1/rewards", json={"groups": [group], "spec": {"components": COMPONENTS}}, timeout=120
    )
    assert r.status_code == 200, r.text
    rows = r.json()["results"][0]["rewards"]
    passes = [x["components"]["code_pass"] for x in rows]
    assert passes == [1.0, 0.75, 0.0, 0.0, 0.0]
    assert [x["components"]["code_all"] for x in rows] == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert [x["components"]["accuracy"] for x in rows] == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert [x["status"] for x in rows] == ["ok", "ok", "ok", "ok", "no_answer"]
    assert "timeout" in rows[2]["detail"]


# one sandbox run for all of a program's tests, a process per test: a hang, a crash and a changed
# interpreter in one test leave the others' outcomes and state alone
MIXED = (
    "```python\nimport builtins\na, b = map(int, input().split())\n"
    "if hasattr(builtins, 'seen'):\n    print('leaked')\nbuiltins.seen = 1\n"
    "if a == 5:\n    while True:\n        pass\nif a == 10:\n    raise ValueError(a)\nprint(a + b)\n```"
)


def test_a_programs_tests_share_one_run_but_not_their_state(reward_url: str) -> None:
    runs = plan_runs(read_tests(TESTS), MIXED, CodeParams(timeout_s=1))
    assert isinstance(runs, list) and len(runs) == 1
    group = {
        "id": "m",
        "task": "code",
        "label": TESTS,
        "trajectories": [{"id": "m0", "group_id": "m", "text": MIXED}],
    }
    r = httpx.post(
        f"{reward_url}/v1/rewards", json={"groups": [group], "spec": {"components": COMPONENTS}}, timeout=120
    )
    assert r.status_code == 200, r.text
    row = r.json()["results"][0]["rewards"][0]
    assert row["components"]["code_pass"] == 0.5 and row["status"] == "ok"
    assert "(ok,timeout,runtime_error,ok)" in row["detail"]


def test_assert_style_tests_and_a_bash_program(reward_url: str) -> None:
    label = json.dumps(
        {"asserts": ["assert double(2) == 4", "assert double(-1) == -2", "assert double(0) == 1"]}
    )
    bash = json.dumps({"language": "bash", "inputs": ["3\n"], "outputs": ["6"]})
    groups = [
        {"id": "a", "task": "code", "label": label, "trajectories": [
            {"id": "x", "group_id": "a", "text": "```python\ndef double(x):\n    return 2 * x\n```"}]},
        {"id": "b", "task": "code", "label": bash, "trajectories": [
            {"id": "y", "group_id": "b", "text": "```bash\nread n; echo $((n * 2))\n```"}]},
    ]  # fmt: skip
    r = httpx.post(
        f"{reward_url}/v1/rewards", json={"groups": groups, "spec": {"components": COMPONENTS}}, timeout=60
    )
    a, b = (g["rewards"][0] for g in r.json()["results"])
    assert a["components"]["code_pass"] == pytest.approx(2 / 3) and a["components"]["code_all"] == 0.0
    assert b["components"]["code_all"] == 1.0


def test_openrlhf_and_slime_protocols_take_the_code_task(reward_url: str) -> None:
    body = {"query": [RIGHT, HALF], "prompts": ["", ""], "labels": [json.loads(TESTS)] * 2}
    o = httpx.post(f"{reward_url}/get_reward?task=code", json=body, timeout=60).json()
    assert o["rewards"] == [1.0, 0.0] and o["scores"] == [1.0, 0.0]
    s = httpx.post(
        f"{reward_url}/v1/slime/reward/components?task=code",
        json={
            "prompt": "add",
            "response": HALF,
            "label": json.loads(TESTS),
            "spec": {"components": COMPONENTS},
        },
        timeout=60,
    ).json()
    assert s["code_pass"] == 0.75 and s["status"] == "ok"


def test_trl_reward_function_scores_code(reward_url: str) -> None:
    from loom.clients.trl import make_reward_func

    fn = make_reward_func(reward_url, task="code", components=[{"name": "code_pass"}], label_column="tests")
    got = fn(prompts=["add", "add", "add"], completions=[RIGHT, HALF, NOCODE], tests=[json.loads(TESTS)] * 3)
    assert got == [1.0, 0.75, 0.0]


def test_verl_reward_function_scores_code(reward_url: str) -> None:
    from loom.clients.verl import compute_score_batch

    out = compute_score_batch(
        ["code"] * 2, [RIGHT, HANG], [json.loads(TESTS)] * 2, [{"task": "code", "uid": "u"}] * 2,
        loom_url=reward_url, loom_components=[{"name": "code_all", "params": {"timeout_s": 1}}],
    )  # fmt: skip
    assert [o["score"] for o in out] == [1.0, 0.0]


def test_an_unreachable_sandbox_is_each_items_sandbox_error() -> None:
    from loom.contracts.wire import Group, RewardSpec
    from reward_svc.core import score_group

    group = Group.model_validate(
        {
            "id": "g",
            "task": "code",
            "label": TESTS,
            "trajectories": [{"id": "t", "group_id": "g", "text": RIGHT}],
        }
    )
    result = score_group(group, RewardSpec(components=COMPONENTS), lambda items, t: [])
    assert result.rewards[0].status == "sandbox_error" and result.rewards[0].total == 0.0


def test_a_reward_worker_scores_code_over_the_queue(broker_env, loom_worker, sandbox_url: str) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    """``reward.score_group`` on a real reward worker process, which reaches the sandbox service at
    ``LOOM_REWARD_SANDBOX_URL``, as the gateway's pipeline publishes code groups."""
    from loom.contracts.wire import Group, RewardResult, RewardSpec
    from reward_svc.tasks import submit_group

    broker_env.extra_env["LOOM_REWARD_SANDBOX_URL"] = sandbox_url
    broker_env.extra_env["LOOM_REWARD_WORKERS"] = "1"
    loom_worker("reward", broker_env)
    group = Group.model_validate(
        {
            "id": "q",
            "task": "code",
            "label": TESTS,
            "trajectories": [
                {"id": "a", "group_id": "q", "text": RIGHT},
                {"id": "b", "group_id": "q", "text": BOMB},
            ],
        }
    )
    spec = RewardSpec(components=COMPONENTS)  # type: ignore[arg-type]
    res = RewardResult.model_validate(
        submit_group(group, spec, app=broker_env.app("reward")).get(timeout=120)
    )
    assert [r.components["code_pass"] for r in res.rewards] == [1.0, 0.0]
    assert [r.status for r in res.rewards] == ["ok", "ok"]
