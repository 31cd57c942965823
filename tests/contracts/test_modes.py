"""loom.contracts.modes: one typed params model per rollout mode, parsed as the rollout service and the
gateway both parse them (strict types, unknown keys refused, the deployment's limits applied)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Any, get_args

import pytest

from loom.contracts.modes import (
    MODE_PARAMS,
    ModeError,
    ModeLimits,
    PlainParams,
    SpawnParams,
    StreamingParams,
    TreeParams,
    parse_mode_params,
)
from loom.contracts.settings import Settings
from loom.contracts.wire import Mode, RolloutRequest, SamplingParams
from loom.formats import DEFAULT_SPAWN

REPO = Path(__file__).resolve().parents[2]
SENTENCES = ["a b.", "c d e."]


def parse(
    mode: str, limits: ModeLimits | None = None, sampling: SamplingParams | None = None, **mp: Any
) -> Any:
    request = RolloutRequest(mode=mode, prompt="x", mode_params=mp, sampling=sampling or SamplingParams())  # type: ignore[arg-type]
    return parse_mode_params(request, limits)


def test_the_mode_table_is_the_schemas_mode_names() -> None:
    assert set(MODE_PARAMS) == set(get_args(Mode))
    assert MODE_PARAMS["plain"] is PlainParams and MODE_PARAMS["spawn"] is SpawnParams


def test_the_rollout_service_serves_the_contracts_modes() -> None:
    from rollout_svc.modes import MODES, mode_runner

    assert set(MODES) == set(MODE_PARAMS)
    assert all(MODES[name][0] is params for name, params in MODE_PARAMS.items())
    assert all(callable(mode_runner(name)) for name in MODES)


def test_plain_takes_no_params() -> None:
    assert parse("plain") == PlainParams()
    with pytest.raises(ModeError, match=r"plain takes no mode_params, got \['layout'\]"):
        parse("plain", layout="interleaved")


def test_defaults_follow_the_request_and_the_deployment() -> None:
    limits = ModeLimits(segment_cap=33, reading_wpm=90.0, max_attention_timeout_s=10.0)
    s = parse("streaming", limits, SamplingParams(max_tokens=77), sentences=SENTENCES)
    assert (s.segment_cap, s.reading_wpm, s.deep_max_tokens, s.answer_max_tokens) == (33, 90.0, 77, 64)
    t = parse("tree", limits, SamplingParams(n=5))
    assert (t.initial, t.attention_timeout_s, t.branches, t.continuations) == (5, 10.0, 2, 2)
    assert parse("tree", limits, SamplingParams(n=1)).initial == 6  # M' when n leaves it open
    assert ModeLimits() == ModeLimits.from_settings(Settings())  # the defaults are the settings'


def test_context_is_split_into_sentences_and_sentences_win() -> None:
    assert parse("streaming", context="One. Two? Three!").sentences == ["One.", "Two?", "Three!"]
    assert parse("streaming", sentences=["x"], context="One. Two.").sentences == ["x"]
    with pytest.raises(ModeError, match="at least one sentence"):
        parse("streaming", context=None)
    with pytest.raises(ModeError, match="needs mode_params.sentences"):
        parse("streaming")


@pytest.mark.parametrize(
    ("mode", "mode_params", "needle"),
    [
        ("tree", {"initial": True}, "initial must be int, got bool"),
        ("tree", {"initial": 3.0}, "initial must be int, got float"),
        ("tree", {"train_prefix": 1}, "train_prefix must be bool, got int"),
        ("tree", {"strategy": 3}, "strategy must be 'attention', 'entropy' or 'random'"),
        ("tree", {"quantile": True}, "quantile must be float, got bool"),
        ("tree", {"entropy_stop_words": None}, "entropy_stop_words must be a list of strings"),
        ("tree", {"entropy_stop_words": ["a", 1]}, "entropy_stop_words must be a list of strings"),
        ("tree", {"separator": ""}, "separator must be non-empty"),
        ("tree", {"initial": 0}, r"initial must be in \[1, 256\], got 0"),
        ("tree", {"branchez": 2}, r"tree does not know mode_params \['branchez'\]"),
        ("tree", {"attention_url": "http://x"}, "attention_url is not accepted"),
        ("tree", {"attention_timeout_s": 121}, "at most 120.0 s"),
        ("streaming", {"sentences": None}, "sentences must be a list of strings"),
        ("streaming", {"context": 3}, "context must be str, got int"),
        ("streaming", {"sentences": ["a"] * 1025}, "at most 1024 sentences"),
        ("streaming", {"sentences": SENTENCES, "reading_wpm": 0}, "reading_wpm must be a finite number > 0"),
        ("streaming", {"sentences": SENTENCES, "segment_cap": 8193}, r"segment_cap must be in \[1, 8192\]"),
        ("spawn", {"max_depth": 5}, r"max_depth must be in \[0, 4\], got 5"),
        ("spawn", {"child_max_tokens": 0}, "child_max_tokens must be >= 1"),
        ("spawn", {"join_close": " "}, r"must not be blank: \['join_close'\]"),
        ("spawn", {"child_template": "{x} {message}"}, "child_template may only use"),
    ],
)
def test_bad_params_are_mode_errors_naming_the_parameter(mode: str, mode_params: dict, needle: str) -> None:
    with pytest.raises(ModeError, match=needle):
        parse(mode, **mode_params)


def test_null_is_the_default_and_floats_accept_ints() -> None:
    t = parse("tree", initial=None, quantile=1, fci_running_mean=2)
    assert (
        t.initial == 6 and t.quantile == 1.0 and isinstance(t.quantile, float) and t.fci_running_mean == 2.0
    )
    assert parse("streaming", sentences=SENTENCES, reading_wpm=60).reading_wpm == 60.0


def test_the_limits_bound_the_request() -> None:
    tight = ModeLimits(segment_cap=8, max_attention_timeout_s=5.0)
    assert parse("tree", tight, attention_timeout_s=5).attention_timeout_s == 5.0
    with pytest.raises(ModeError, match="at most 5.0 s"):
        parse("tree", tight, attention_timeout_s=6)


def test_spawn_syntax_is_built_from_the_params() -> None:
    p = parse("spawn", spawn_open="<S>", no_solution="none")
    assert p.syntax.spawn_open == "<S>" and p.syntax.no_solution == "none"
    assert p.syntax.join_close == DEFAULT_SPAWN.join_close and p.syntax.tokens == DEFAULT_SPAWN.tokens


def test_models_without_a_request_use_the_default_limits() -> None:
    assert (
        TreeParams().initial == 6 and TreeParams().attention_timeout_s == ModeLimits().max_attention_timeout_s
    )
    assert StreamingParams(sentences=["x"]).segment_cap == ModeLimits().segment_cap


def test_the_contract_imports_no_service() -> None:
    code = (
        "import sys, loom.contracts.modes; "
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('rollout_svc', 'gateway', 'reward_svc', 'learner', 'reflect_svc')]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_gateway_never_imports_the_rollout_service() -> None:
    for path in (REPO / "gateway").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.split(".")[0] == "rollout_svc" for n in names), path
