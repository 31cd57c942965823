"""The built-in programming problems (zoo/code/tasks.py): every reference solution passes its own
tests in the real sandbox service and another problem's solution fails them, the labels are the code
reward's form, the held-out split is disjoint from training, and the gateway serves them as the
``code`` dataset."""

from __future__ import annotations

import pytest

from gateway.datasets import DatasetError, load_dataset
from gateway.models import DatasetSpec
from loom.clients.sandbox import SandboxClient
from loom.contracts.sandbox import Limits, RunRequest
from reward_svc.code import CodeTests, read_tests
from tests.sandbox.conftest import sandbox_url  # noqa: F401  (the fixture)
from zoo.code import HELDOUT_SEED, code_problems, code_prompt, is_held_out
from zoo.code.tasks import SOURCES, TESTS
from zoo.code.traces import completion, program_of

LIMITS = Limits(cpu_s=2, wall_s=4, memory_mb=256)


def _runs(solution: str, asserts: tuple[str, ...]) -> list[RunRequest]:
    return [RunRequest(code=f"{solution}\n\n{a}\n", limits=LIMITS) for a in asserts]


def test_reference_solutions_pass_their_tests_and_others_fail_them(sandbox_url: str) -> None:  # noqa: F811
    by_source = [code_problems(8, seed=3, sources=(s,)) for s in SOURCES]
    problems = [p for ps in by_source for p in ps]
    client = SandboxClient(sandbox_url)
    own = client.run_batch([r for p in problems for r in _runs(p.solution, p.asserts)])
    assert len(own) == TESTS * len(problems)
    assert [r.status for r in own] == ["ok"] * len(own), [r.stderr for r in own if r.status != "ok"][:3]
    # each problem's tests against the next problem's solution of the same source (same argument)
    swapped = [(p.asserts, ps[(i + 1) % len(ps)].solution) for ps in by_source for i, p in enumerate(ps)]
    other = client.run_batch([r for asserts, sol in swapped for r in _runs(sol, asserts)])
    failed = [any(r.status != "ok" for r in other[k * TESTS : (k + 1) * TESTS]) for k in range(len(swapped))]
    assert sum(failed) >= 0.8 * len(swapped)  # the tests tell problems apart
    assert {r.status for r in other} <= {"ok", "runtime_error"}


def test_labels_hold_the_tests_in_the_code_rewards_form() -> None:
    for p in code_problems(30, seed=1):
        tests = read_tests(p.label)
        assert isinstance(tests, CodeTests) and tests.asserts == list(p.asserts) and len(tests) == TESTS
        assert tests.language == "python" and all(a.startswith("assert f(") for a in p.asserts)
        assert program_of(completion(p)) == p.solution  # the trace's block is what the reward runs
        assert code_prompt(p) == f"[code] {p.text}\n"


def test_the_held_out_split_is_disjoint_from_training() -> None:
    train = code_problems(1500, seed=0, split="train")
    held = code_problems(200, seed=HELDOUT_SEED, split="test")
    assert not {p.key for p in train} & {p.key for p in held}
    assert not any(is_held_out(p) for p in train) and all(is_held_out(p) for p in held)
    assert len({p.key for p in train}) == 1500 and {p.source for p in held} == set(SOURCES)
    assert code_problems(50, seed=0, split="train") == train[:50]  # same arguments, same list
    # a statement is one problem whatever drew it: the same text has the same tests
    other_seed = {p.key: p for p in code_problems(1500, seed=7, split="train")}
    shared = [p for p in train if p.key in other_seed]
    assert shared and all(other_seed[p.key] == p for p in shared)


def test_the_gateway_serves_them_as_the_code_dataset() -> None:
    items = load_dataset(DatasetSpec(builtin="code", size=40, seed=2))
    assert len(items) == 40 and {i.task for i in items} == {"code"}
    held = {code_prompt(p) for p in code_problems(300, seed=HELDOUT_SEED, split="test")}
    assert all(i.prompt.startswith("[code] Write f(") and i.prompt not in held for i in items)
    assert all(isinstance(read_tests(i.label), CodeTests) for i in items)
    strings = load_dataset(DatasetSpec(builtin="code", size=10, knobs={"sources": ["string"]}))
    assert all(i.prompt.startswith("[code] Write f(s):") for i in strings)
    with pytest.raises(DatasetError, match="plain"):
        load_dataset(DatasetSpec(builtin="code", size=4), mode="streaming")
    with pytest.raises(ValueError, match="sources"):
        DatasetSpec(builtin="code", knobs={"sources": ["trees"]})
