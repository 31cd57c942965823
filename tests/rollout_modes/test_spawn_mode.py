"""spawn mode (APR): strict spawn-block parsing incl. malformed and adversarial blocks, and rollouts
on Loom's tiny model: a forest with links, per-call loss masks, token-exact resumed parent trace."""

from __future__ import annotations

from asyncio import run

import pytest

from loom.contracts.modes import parse_mode_params
from loom.contracts.wire import RolloutRequest, SamplingParams
from loom.formats import DEFAULT_SPAWN
from rollout_svc.engines.torch import teacher_forced_logprobs
from rollout_svc.modes import ModeError
from rollout_svc.modes.spawn import (
    SpawnChild,
    SpawnFormatError,
    join_text,
    parse_spawn_block,
    spawn,
)
from zoo.tiny import make_problems, spawn_prompt
from zoo.tiny.traces import spawn_trace, trace_text

S = DEFAULT_SPAWN
PROBLEM = make_problems("countdown", 1, seed=1)[0]


def _block(*lines: str) -> str:
    return "<think> 22:[3,5,7]\n" + "\n".join([S.spawn_open, *lines, S.spawn_close])


def test_parses_the_training_format():
    trace = spawn_trace(PROBLEM)
    text = trace.parent[1].text  # the parent's generated part, ending with the spawn block
    children = parse_spawn_block(text)
    assert isinstance(children, list) and len(children) == len(trace.children)
    assert [c.index for c in children] == list(range(len(children)))
    assert all(c.message and c.node == str(c.index) for c in children)
    assert join_text([c.message for c in children][:1]).startswith("\n" + S.join_open)
    assert trace_text(trace.parent).count(join_text(trace.messages)) == 1  # same layout as training


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("no open marker " + S.spawn_close, "without an opening"),
        (_block(), "no children"),
        (_block("<Start Sub Search 0 at level 1> Moving to Node #0 3*5=15", "hello"), "not a child line"),
        (_block("<Start Sub Search 0 at level 1> Moving to Node #0"), "empty message"),
        (
            _block(
                "<Start Sub Search 0 at level 1> Moving to Node #0 a",
                "<Start Sub Search 0 at level 1> Moving to Node #1 b",
            ),
            "duplicate",
        ),
        (
            _block(*(f"<Start Sub Search {i} at level 1> Moving to Node #{i} m" for i in range(9))),
            "exceed the limit",
        ),
        (_block("<Start Sub Search 0 at level 1> Moving to Node #0 x " + S.join_close), "marker"),
        (_block("<Start Sub Search 0 at level 1> Moving to Node #0 " + "9" * 600), "exceeds 512"),
        (_block("<Start Sub Search 99999 at level 1> Moving to Node #0 m"), "not a child line"),
        ("text without the close marker", "does not end"),
    ],
)
def test_malformed_and_adversarial_blocks_are_format_errors(text, reason):
    out = parse_spawn_block(text, S, max_children=8)
    assert isinstance(out, SpawnFormatError) and reason in out.reason


def test_nested_open_marker_uses_the_last_block():
    text = S.spawn_open + " junk\n" + _block("<Start Sub Search 0 at level 1> Moving to Node #0 m")
    assert parse_spawn_block(text) == [SpawnChild(0, "0", "m")]


def _request(**mode_params) -> RolloutRequest:
    return RolloutRequest(
        mode="spawn",
        prompt=spawn_prompt(PROBLEM),
        sampling=SamplingParams(max_tokens=200, temperature=0.0, n=1),
        mode_params=mode_params,
    )


def _spawn(engine, request):
    ids = engine.tokenizer.encode(request.prompt, add_special_tokens=False)
    return run(spawn(request, ids, "g", engine, engine.tokenizer, parse_mode_params(request)))


def test_spawn_rollout_is_a_forest_with_loss_masks_and_exact_resume(tiny_engine):
    group = _spawn(tiny_engine, _request())
    tok = tiny_engine.tokenizer
    (root,) = [t for t in group.trajectories if t.parent_id is None]
    children = [t for t in group.trajectories if t.parent_id == root.id]
    assert group.meta["rollouts"][0]["status"] == "ok"
    assert len(children) >= 1 and group.meta["children"] == len(children)
    assert {(ln.parent, ln.child) for ln in group.threads} == {(root.id, c.id) for c in children}
    # children: their own short context, every token trained
    for c in children:
        assert tok.decode(c.prompt_ids).startswith("[child] ") and set(c.loss_mask) == {1}
        assert c.meta["depth"] == 1
    # parent: the join block holds exactly the children's returned messages and is not trained
    (join,) = [s for s in root.segments if s.kind == "observation"]
    messages = [ln.message for ln in group.threads]
    assert root.completion_ids[join.start : join.end] == tok.encode(
        join_text(messages), add_special_tokens=False
    )
    assert root.loss_mask == [0 if join.start <= i < join.end else 1 for i in range(len(root.completion_ids))]
    assert tok.decode(root.completion_ids[: join.start]).endswith(
        S.spawn_close
    )  # own trace, spawn block kept
    # token exactness: the behaviour log-probs are those of the exact sequence the learner will see
    seq = root.prompt_ids + root.completion_ids
    want = teacher_forced_logprobs(tiny_engine.model, seq, len(root.prompt_ids))
    trained = [i for i, m in enumerate(root.loss_mask) if m]
    assert [root.logprobs[i] for i in trained] == pytest.approx([want[i] for i in trained], abs=1e-4)
    # metrics: total over all calls, sequential = parent + the slowest child
    total = sum(sum(t.loss_mask) for t in group.trajectories)
    assert group.meta["total_tokens"] == total
    assert group.meta["sequential_tokens"] == sum(root.loss_mask) + max(
        len(c.completion_ids) for c in children
    )
    assert group.meta["wall_s"] > 0


@pytest.mark.parametrize(
    ("params", "reason"),
    [
        ({"max_depth": 0}, "exceeds max_depth"),
        ({"max_children": 1}, "exceed the limit"),
        ({"spawn_child": "<Child {i}> #{node}"}, "not a child line"),
    ],
)
def test_a_malformed_spawn_ends_the_rollout_with_a_format_failure(tiny_engine, params, reason):
    group = _spawn(tiny_engine, _request(**params))
    summary = group.meta["rollouts"][0]
    assert summary["status"] == "format_error" and reason in summary["reason"]
    (root,) = group.trajectories
    assert root.finish_reason == "abort" and root.meta["status"] == "format_error"
    assert tiny_engine.tokenizer.decode(root.completion_ids).endswith(S.spawn_close)


def test_token_budget_bounds_the_whole_forest(tiny_engine):
    for budget in (60, 140):  # the parent is cut before / the children after the spawn block
        group = _spawn(tiny_engine, _request(max_total_tokens=budget))
        assert group.meta["total_tokens"] <= budget
        assert group.meta["rollouts"][0]["status"] == "ok"
        assert any(t.finish_reason == "length" for t in group.trajectories)
    assert group.meta["children"] >= 1


def test_bad_spawn_params_are_mode_errors():
    with pytest.raises(ModeError, match="does not know"):
        parse_mode_params(_request(max_kids=2))
    with pytest.raises(ModeError, match="max_children"):
        parse_mode_params(_request(max_children=0))
    with pytest.raises(ModeError, match="max_message_chars"):
        parse_mode_params(_request(max_message_chars=-1))
    with pytest.raises(ModeError, match=r"must not be blank: \['spawn_open'\]"):
        parse_mode_params(_request(spawn_open=""))


@pytest.mark.parametrize(
    ("mode_params", "needle"),
    [
        (
            {"child_template": "[child] {message}{x}\n"},
            r"child_template may only use the placeholders \{message\}",
        ),
        ({"join_child": "<Result of Sub Search {i}> {message} {0}"}, r"join_child may only use .*\{i\}"),
        ({"child_template": "{message!r}"}, "got {message!r}"),
        ({"child_template": "{message:>999999999}"}, "got {message:>999999999}"),
        ({"child_template": "{message.__class__}"}, "placeholders"),
        ({"join_child": "{i} {message"}, "literal braces"),
        ({"child_template": "{{message}}"}, "must contain {message}"),
    ],
)
def test_spawn_templates_are_checked_before_the_first_spawn(mode_params, needle):
    """str.format would raise KeyError / IndexError (a 500) only once a child is spawned."""
    with pytest.raises(ModeError, match=needle):
        parse_mode_params(_request(**mode_params))


def test_spawn_templates_may_hold_literal_braces():
    cfg = parse_mode_params(
        _request(child_template="{{child}} {message}\n", join_child="[{i}] {message} {{}}")
    )
    assert cfg.child_template.format(message="m") == "{child} m\n"
    assert join_text(["m"], cfg.syntax).splitlines()[2] == "[0] m {}"
