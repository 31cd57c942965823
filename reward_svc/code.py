"""Code rewards (docs/sandbox.md "Code rewards"): the policy's program, run in the sandbox per test.

The label holds the tests, as JSON: stdin/stdout cases (``{"inputs": [...], "outputs": [...]}``,
the form of verl's ``sandbox_fusion`` reward and of PRIME/TACO-style datasets, or ``{"tests":
[{"stdin", "stdout"}]}``), or assert-style checks (``{"asserts": ["assert f(1) == 2", ...]}``;
verl's ``assert_case`` is read too). ``language`` is ``python`` (default) or ``bash``. The program is
the last fenced code block of the answer (``extract_program``).

A Python program's tests share one sandbox run (``_DRIVER``): a driver forks the program once per
test (a fresh process each: one test's memory never leaks into the next; its own CPU limit and wall
clock: one test's hang costs only that test), so an item pays one sandbox start, not one per test.
What the tests of one program share is that run's private tmp and the driver (its uid's): for
stdin/stdout tests nothing they are judged on, since the expected outputs stay outside and stdout is
compared here. An assert's pass is its process's exit status, which the program can forge in one run
as in many (``os._exit(0)`` before the assert): the assert form trusts the program's exit either
way (docs/sandbox.md). Bash stays one run per test. An item's runs go to the sandbox in one batch
with every other item's, so they run at once on its warm slots. ``code_pass`` is the fraction of
tests passed, ``code_all`` 1 when every test passed; the ``accuracy`` of a ``code`` task
is ``code_all``. Pure: the runs are made by the caller (``reward_svc.core``) through the sandbox
service's client.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, cast

from loom.contracts.rewards import CodeParams
from loom.contracts.sandbox import Language, Limits, RunRequest, RunResult, RunStatus
from reward_svc.context import GroupContext, reads

_FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)
_LANGS: dict[str, Language] = {
    "python": "python",
    "py": "python",
    "python3": "python",
    "bash": "bash",
    "sh": "bash",
}


@dataclass(frozen=True)
class CodeTests:
    language: Language
    stdin: list[str]
    stdout: list[str] | None  # None: assert-style (a test passes when its run exits 0)
    asserts: list[str] | None = None

    def __len__(self) -> int:
        return len(self.asserts) if self.asserts is not None else len(self.stdin)


@dataclass(frozen=True)
class CodeVerdict:
    status: str  # ok | no_answer | invalid | sandbox_error
    passed: float = 0.0  # fraction of tests passed
    detail: str | None = None

    @property
    def all_passed(self) -> bool:
        return self.status == "ok" and self.passed == 1.0


def extract_program(text: str) -> tuple[str | None, str] | None:
    """(fence language or None, code) of the last fenced block; None when the text has none."""
    blocks = _FENCE.findall(text)
    if not blocks:
        return None
    tag, code = blocks[-1]
    return (tag.lower() or None), code


def read_tests(label: str | None) -> CodeTests | CodeVerdict:
    """The tests of a label, or the ``invalid`` verdict every trajectory of the group gets."""
    if label is None or not label.strip():
        return CodeVerdict("invalid", detail="group has no label (the code task's tests)")
    try:
        raw: Any = json.loads(label)
    except json.JSONDecodeError:
        return CodeVerdict("invalid", detail="the label is not JSON tests")
    if not isinstance(raw, dict):
        return CodeVerdict("invalid", detail="the label's tests must be a JSON object")
    language = _LANGS.get(str(raw.get("language", "python")).lower())
    if language is None:
        return CodeVerdict("invalid", detail=f"language {raw.get('language')!r} is not run by the sandbox")
    asserts = raw.get("asserts", raw.get("assert_case"))
    if isinstance(asserts, list) and asserts and all(isinstance(a, str) for a in asserts):
        return CodeTests(language, [""] * len(asserts), None, list(asserts))
    if isinstance(raw.get("tests"), list):
        cases = raw["tests"]
        if all(isinstance(c, dict) and isinstance(c.get("stdout"), str) for c in cases):
            raw = {"inputs": [c.get("stdin", "") for c in cases], "outputs": [c["stdout"] for c in cases]}
    ins, outs = raw.get("inputs"), raw.get("outputs")
    if not (isinstance(ins, list) and isinstance(outs, list) and ins and len(ins) == len(outs)):
        return CodeVerdict("invalid", detail="tests need inputs and outputs of one length, or asserts")
    return CodeTests(language, [_text(i) for i in ins], [_text(o) for o in outs])


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


# One run of a Python program over all its stdin tests: a child per test (its own process group, fds
# 0-2 on files in the run's tmp, RLIMIT_CPU of one test), killed at the test's wall time; one JSON line
# per test on the driver's stdout as each ends, so the tests before a run-level failure still count.
# This text runs inside the sandbox run (bubblewrap, the run's limits: docs/sandbox.md), never in the
# reward process: its exec of the model's program is the run itself.
_DRIVER = """\
import json, os, resource, signal, sys, time
PROGRAM, CASES, CPU, WALL, OUT = json.loads(sys.stdin.read())
for i, (case, check) in enumerate(CASES):
    paths = [f"/tmp/.t{i}.{n}" for n in ("in", "out", "err")]
    with open(paths[0], "w") as f:
        f.write(case)
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)
        resource.setrlimit(resource.RLIMIT_CPU, (CPU, CPU + 1))
        write = os.O_WRONLY | os.O_CREAT
        for fd, path, mode in zip((0, 1, 2), paths, (os.O_RDONLY, write, write)):
            os.dup2(os.open(path, mode, 0o600), fd)
        sys.stdin = open(0, closefd=False)
        sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)
        rc = 0
        try:
            code = compile(PROGRAM + check, "<program>", "exec")
            exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            import traceback
            traceback.print_exc()
            rc = 1
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(rc & 255)
    end, status = time.monotonic() + WALL, None
    while status is None:
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = st
        elif time.monotonic() > end:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            status = -1
        else:
            time.sleep(0.002)
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    if status == -1:
        outcome = "timeout"
    elif os.WIFSIGNALED(status):
        outcome = "timeout" if os.WTERMSIG(status) in (signal.SIGXCPU, signal.SIGKILL) else "killed"
    else:
        outcome = "ok" if os.WEXITSTATUS(status) == 0 else "runtime_error"
    with open(paths[1], errors="replace") as f:
        out = f.read(OUT)
    for path in paths:
        os.unlink(path)
    print(json.dumps({"i": i, "status": outcome, "stdout": out}), flush=True)
"""


def plan_runs(
    tests: CodeTests | CodeVerdict, text: str | None, params: CodeParams
) -> list[RunRequest] | CodeVerdict:
    """The sandbox runs of one trajectory (one per test), or its verdict without running anything."""
    if isinstance(tests, CodeVerdict):
        return tests
    if text is None:
        return CodeVerdict("invalid", detail="trajectory has no text")
    found = extract_program(text)
    if found is None or not found[1].strip():
        return CodeVerdict("no_answer", detail="no fenced code block")
    tag, program = found
    language = _LANGS.get(tag or "", tests.language)
    limits = Limits(
        cpu_s=params.timeout_s,
        wall_s=params.timeout_s * 2,
        memory_mb=params.memory_mb,
        output_bytes=params.output_bytes,
    )
    checks = [f"\n\n{a}\n" for a in tests.asserts] if tests.asserts is not None else [""] * len(tests)
    n = len(tests)
    if language == "python" and n > 1:
        cpu = max(1, math.ceil(params.timeout_s))
        cases = [[s, c] for s, c in zip(tests.stdin, checks, strict=True)]
        each = [program, cases, cpu, params.timeout_s * 2, params.output_bytes]
        whole = Limits(
            cpu_s=min(600.0, (cpu + 1) * n + 1),
            wall_s=min(600.0, (params.timeout_s * 2 + 0.5) * n + 2),
            memory_mb=params.memory_mb,
            output_bytes=min(64 << 20, (params.output_bytes + 256) * 2 * n),
        )
        return [RunRequest(language="python", code=_DRIVER, stdin=json.dumps(each), limits=whole)]
    if tests.asserts is not None:
        return [RunRequest(language=language, code=f"{program}{c}", limits=limits) for c in checks]
    return [RunRequest(language=language, code=program, stdin=s, limits=limits) for s in tests.stdin]


def same_output(got: str, want: str) -> bool:
    """Outputs compared line by line with trailing whitespace dropped (the judges' usual rule)."""
    a = [ln.rstrip() for ln in got.strip().splitlines()]
    b = [ln.rstrip() for ln in want.strip().splitlines()]
    return a == b


def unbatch(tests: CodeTests, run: RunResult) -> list[RunResult]:
    """Each test's outcome from the driver's run of them all; a test without its line (the run ended
    first: its wall time, memory) gets the run's status, or ``killed`` when the run ended ``ok``."""
    if run.status == "sandbox_error":
        return [run] * len(tests)
    got: dict[int, RunResult] = {}
    for line in run.stdout.splitlines():
        try:
            row = json.loads(line)
            i, status, out = int(row["i"]), row["status"], str(row["stdout"])
        except (ValueError, KeyError, TypeError):
            continue
        if 0 <= i < len(tests) and i not in got and status in ("ok", "runtime_error", "timeout", "killed"):
            got[i] = RunResult(status=cast(RunStatus, status), stdout=out)
    rest: RunStatus = "killed" if run.status == "ok" else run.status
    return [got.get(i, RunResult(status=rest, detail=run.detail)) for i in range(len(tests))]


def judge(tests: CodeTests, results: list[RunResult]) -> CodeVerdict:
    """The verdict of one trajectory's runs: the fraction passed; a sandbox failure is
    ``sandbox_error`` (not the policy's fault: reward 0 and a status a trainer can filter on)."""
    if len(results) == 1 < len(tests):
        results = unbatch(tests, results[0])
    if any(r.status == "sandbox_error" for r in results):
        why = next(r.detail for r in results if r.status == "sandbox_error")
        return CodeVerdict("sandbox_error", detail=why)
    passed = 0
    for i, r in enumerate(results):
        if tests.stdout is None:
            passed += r.status == "ok"
        else:
            passed += r.status == "ok" and same_output(r.stdout, tests.stdout[i])
    outcomes = ",".join(r.status for r in results)
    return CodeVerdict(
        "ok", passed / len(results), detail=f"{passed}/{len(results)} passed ({outcomes})"[:500]
    )


def code_verdicts(ctx: GroupContext) -> list[CodeVerdict]:
    return ctx.verdicts("code", "the code verdicts")


@reads("code")
def code_pass(ctx: GroupContext, params: dict[str, Any]) -> list[float]:
    """The fraction of the item's tests its program passed."""
    CodeParams.model_validate(params)
    return [v.passed if v.status == "ok" else 0.0 for v in code_verdicts(ctx)]


@reads("code")
def code_all(ctx: GroupContext, params: dict[str, Any]) -> list[float]:
    """1 when the program passed every test, else 0."""
    CodeParams.model_validate(params)
    return [float(v.all_passed) for v in code_verdicts(ctx)]
