"""env_svc/adapters/skyrl_gym.py over skyrl-gym's real environments (docs/environments.md,
"Environment libraries"): ``skyrl_gym.make`` from its registry, ``init`` / ``step`` / ``close`` of
its own ``GSM8kEnv``, ``GSM8kMultiTurnEnv``, ``AIMEEnv`` and ``SQLEnv`` (on a SQLite database made
here), and the adapter's refusals. skyrl-gym shares the main venv (deploy/setup.sh)."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

pytest.importorskip("skyrl_gym", reason="skyrl-gym is installed by deploy/setup.sh (skyrl-gym==0.4.0)")

from env_svc.adapters.skyrl_gym import SkyRLGymEnvironment, SkyRLSettings, registrations  # noqa: E402
from loom.contracts.envs import EnvAction, EnvTask  # noqa: E402
from tests.env.library_tier import env_worker, episode  # noqa: E402


def task(env: str, question: str, label: str | None, **options: object) -> EnvTask:
    return EnvTask(environment=f"skyrl:{env}", question=question, label=label, options=options)


def act(text: str, turn: int = 0) -> EnvAction:
    return EnvAction(text=text, turn=turn)


def test_gsm8k_one_turn_reward() -> None:
    for answer, reward in (("so #### 42", 1.0), ("so #### 41", 0.0), ("42", 0.0)):
        env = SkyRLGymEnvironment("gsm8k")
        reset = env.reset(task("gsm8k", "6 * 7?", "42"))
        assert reset.observation is None and reset.meta["messages"] == [{"role": "user", "content": "6 * 7?"}]
        step = env.step(act(answer))
        env.close()
        assert (step.reward, step.done, step.observation) == (reward, True, "")


def test_gsm8k_multi_turn_feedback_and_per_turn_rewards() -> None:
    env = SkyRLGymEnvironment("gsm8k_multi_turn")
    env.reset(task("gsm8k_multi_turn", "2 + 2?", "4", max_turns=3))
    first = env.step(act("maybe #### 5"))
    # well-formatted but wrong: the env's format score (0.2 / max_turns) and its next instruction
    assert first.done is False and first.reward == pytest.approx(0.2 / 3)
    assert "#### ANSWER" in first.observation and first.meta["messages"][0]["role"] == "user"
    second = env.step(act("#### 4", 1))
    assert second.done is True and second.reward == 1.0 and second.meta["metrics"] == {"steps": 2}
    env.close()


def test_aime_reads_its_reward_model_ground_truth() -> None:
    env = SkyRLGymEnvironment("aime")
    env.reset(task("aime", "Find n.", "204"))
    right = env.step(act("Answer: \\boxed{204}"))
    assert right.reward == 1.0 and right.meta["metadata"]["acc"] is True
    env = SkyRLGymEnvironment("aime")
    env.reset(task("aime", "Find n.", "204"))
    assert env.step(act("Answer: \\boxed{205}")).reward == -1.0


@pytest.fixture
def sql_root(tmp_path: Path) -> Path:
    db = tmp_path / "spider" / "database" / "shop" / "shop.sqlite"
    db.parent.mkdir(parents=True)
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE items (name TEXT, price INT)")
        conn.executemany("INSERT INTO items VALUES (?, ?)", [("pen", 2), ("ink", 5), ("pad", 3)])
    return tmp_path


def test_text2sql_runs_queries_and_scores_the_solution(sql_root: Path) -> None:
    config = SkyRLSettings(sql_db_path=str(sql_root))
    assert "skyrl:text2sql" in registrations(config)
    env = SkyRLGymEnvironment("text2sql", config)
    gold = "SELECT name FROM items WHERE price > 2"
    env.reset(task("text2sql", "Items over 2?", gold, db_id="shop", max_turns=3))
    probe = env.step(act("<think>look</think><sql>SELECT name FROM items WHERE price > 2</sql>"))
    assert probe.done is False and probe.reward == 0.0
    assert (
        "<observation>" in probe.observation and "ink" in probe.observation and "pen" not in probe.observation
    )
    assert probe.meta["metadata"]["tool_name"] == "sql"
    final = env.step(act("<think>two</think><solution>SELECT name FROM items WHERE price >= 3</solution>", 1))
    assert final.done is True and final.reward == 1.0  # same rows as the gold query on the database
    env.close()


def test_offered_names_and_refusals(sql_root: Path) -> None:
    assert sorted(registrations(SkyRLSettings())) == ["skyrl:aime", "skyrl:gsm8k", "skyrl:gsm8k_multi_turn"]
    with pytest.raises(ValueError, match="not offered"):
        SkyRLGymEnvironment("lcb")  # runs the policy's programs unsandboxed: never offered
    with pytest.raises(ValueError, match="label"):
        SkyRLGymEnvironment("gsm8k").reset(task("gsm8k", "q", None))
    with pytest.raises(ValidationError, match="max_turns"):
        SkyRLGymEnvironment("gsm8k_multi_turn").reset(task("gsm8k_multi_turn", "q", "1", max_turns=0))
    with pytest.raises(ValidationError, match="extra"):
        SkyRLGymEnvironment("gsm8k").reset(task("gsm8k", "q", "1", env_config={"db_path": "/"}))
    sql = SkyRLGymEnvironment("text2sql", SkyRLSettings(sql_db_path=str(sql_root)))
    with pytest.raises(ValidationError, match="db_id"):
        sql.reset(task("text2sql", "q", "SELECT 1", db_id="../../etc"))
    with pytest.raises(ValueError, match="LOOM_ENV_SKYRL_SQL_DB_PATH"):
        SkyRLGymEnvironment("text2sql", SkyRLSettings()).reset(
            task("text2sql", "q", "SELECT 1", db_id="shop")
        )


def test_library_names_in_the_registry_and_the_contracts() -> None:
    from env_svc.registry import REGISTRY, UnknownEnvironment, factory_of
    from loom.contracts.envs import known_environment

    # registered by the registry's own import, where skyrl-gym is installed (this venv)
    assert isinstance(factory_of("skyrl:gsm8k", [])(), SkyRLGymEnvironment)
    assert known_environment("skyrl:gsm8k", []) and known_environment("verifiers:calc", [])
    assert not known_environment("skyrl:no such", [])
    from loom.contracts.modes import AgentParams

    assert AgentParams(environment="verifiers:calc").environment == "verifiers:calc"  # the request check
    with pytest.raises(ValidationError, match="unknown environment"):
        AgentParams(environment="skyrl:../x")
    for name in ("skyrl:lcb", "verifiers:calc"):  # not offered / not this interpreter's library
        assert name not in REGISTRY
        with pytest.raises(UnknownEnvironment, match="not served here"):
            factory_of(name, [])


def test_an_agent_episode_in_gsm8k_multi_turn_on_a_real_env_worker(tmp_path: Path, tiny_engine: Any) -> None:
    """Loom's agent mode, the real torch engine, skyrl-gym's GSM8kMultiTurnEnv on ``loom worker env``:
    the env's instruction is the observation the policy reads, its per-turn rewards the turns'."""
    with env_worker(tmp_path):
        t = episode(
            tiny_engine,
            "Q: 2 + 2?\n",
            "4",
            ["maybe #### 5", "#### 4"],
            environment="skyrl:gsm8k_multi_turn",
            env_options={"max_turns": 3},
        )
    assert t.meta["stop"] == "env_done" and t.meta["turns"] == 2
    assert t.meta["turn_rewards"] == [pytest.approx(0.2 / 3), 1.0]
    kinds = [s.kind for s in t.segments]
    assert kinds == ["turn", "observation", "turn"]
    obs = t.segments[1]
    observed = tiny_engine.tokenizer.decode(t.completion_ids[obs.start : obs.end])
    assert "#### ANSWER" in observed and obs.meta["env"] == "skyrl:gsm8k_multi_turn"
