"""The code model's held-out evaluation: greedy programs run against their problems' tests in the
sandbox service (over HTTP: ``loom/clients/sandbox.py``; model-written code runs nowhere else,
docs/sandbox.md), each test its own run (the code reward, reward_svc/code.py, runs a program's
tests in one run, a process each: the same verdicts).

Two rows: ``code_all`` (problems whose program passed every test) and ``code_pass`` (tests passed
over all tests; every problem has ``zoo.code.tasks.TESTS`` of them, so this is the mean of the code reward's
``code_pass``). A sandbox that cannot run them is an error, never a score of zero.
"""

from __future__ import annotations

from typing import Any

from loom.clients.sandbox import SandboxClient
from loom.contracts.sandbox import Limits, RunRequest
from zoo.code.tasks import CodeProblem, code_prompt
from zoo.code.traces import program_of
from zoo.tiny.evaluate import FormatResult, generate_batch

LIMITS = Limits(cpu_s=2.0, wall_s=4.0, memory_mb=256)
MAX_NEW_TOKENS = 96


def evaluate(
    model: Any, tok: Any, problems: list[CodeProblem], client: SandboxClient | None = None
) -> dict[str, FormatResult]:
    """Greedy completions of ``problems`` scored by their tests in the sandbox."""
    model.eval()
    prompts = [code_prompt(p) for p in problems]
    outs = generate_batch(model, tok, prompts, [], MAX_NEW_TOKENS)
    programs = [program_of(o) for o in outs]
    runs, owners = [], []
    for i, (p, prog) in enumerate(zip(problems, programs, strict=True)):
        for line in p.asserts if prog is not None else ():
            runs.append(RunRequest(code=f"{prog}\n\n{line}\n", limits=LIMITS))
            owners.append(i)
    results = (client or SandboxClient()).run_batch(runs)
    failed = next((r for r in results if r.status == "sandbox_error"), None)
    if failed is not None:
        raise RuntimeError(
            f"the sandbox could not run the held-out programs ({failed.detail}); start it with "
            "`loom api sandbox` (docs/sandbox.md)"
        )
    passed = [0] * len(problems)
    for i, r in zip(owners, results, strict=True):
        passed[i] += r.status == "ok"
    parsed = sum(prog is not None for prog in programs)
    sample = prompts[0] + outs[0] if outs else ""
    return {
        "code_all": FormatResult(
            sum(k == len(p.asserts) for k, p in zip(passed, problems, strict=True)),
            parsed,
            len(problems),
            sample,
        ),
        "code_pass": FormatResult(sum(passed), parsed, sum(len(p.asserts) for p in problems), sample),
    }
