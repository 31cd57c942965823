"""SandboxFusion's ``POST /run_code`` request and response (bytedance/SandboxFusion,
``sandbox/server/sandbox_api.py``'s ``RunCodeRequest`` / ``RunCodeResponse``), translated to and from a
Loom run, so a trainer that calls SandboxFusion (verl's ``sandbox_fusion`` reward,
``verl/utils/reward_score/sandbox_fusion/utils.py``) can point its URL at Loom (docs/sandbox.md).

Loom runs ``python`` and ``bash``; any other language is answered ``SandboxError`` with the reason, as
SandboxFusion answers a run it cannot do. Files (``files``, ``fetch_files``) are not carried.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from loom.contracts.sandbox import Language, Limits, RunRequest, RunResult


class RunCodeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    code: str
    language: str = "python"
    compile_timeout: float = 10
    run_timeout: float = 10
    memory_limit_MB: int = -1  # noqa: N815 (SandboxFusion's field name)
    stdin: str | None = None
    files: dict[str, str | None] = Field(default_factory=dict)
    fetch_files: list[str] = Field(default_factory=list)


class CommandRunResult(BaseModel):
    status: Literal["Finished", "Error", "TimeLimitExceeded"]
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


class RunCodeResponse(BaseModel):
    status: Literal["Success", "Failed", "SandboxError"]
    message: str = ""
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = Field(default_factory=dict)
    loom_status: str | None = Field(default=None, description="Loom's own status of the run")


def to_run(req: RunCodeRequest, defaults: Limits) -> RunRequest | RunCodeResponse:
    """The Loom run of a ``run_code`` request, or the ``SandboxError`` answer when Loom cannot run it."""
    languages: dict[str, Language] = {"python": "python", "python3": "python", "bash": "bash"}
    language = languages.get(req.language)
    if language is None:
        return RunCodeResponse(status="SandboxError", message=f"language {req.language!r} is not run by Loom")
    if req.files or req.fetch_files:
        return RunCodeResponse(status="SandboxError", message="files and fetch_files are not supported")
    timeout = max(0.1, float(req.run_timeout))
    update: dict[str, Any] = {"wall_s": timeout, "cpu_s": timeout}
    if req.memory_limit_MB > 0:
        update["memory_mb"] = max(16, req.memory_limit_MB)
    return RunRequest(
        language=language, code=req.code, stdin=req.stdin or "", limits=defaults.model_copy(update=update)
    )


def from_result(result: RunResult) -> RunCodeResponse:
    """SandboxFusion's answer: ``Success`` only for exit 0; a time-out is ``TimeLimitExceeded``; the
    run's other failures are ``Error`` (what verl reads as a runtime error)."""
    if result.status == "sandbox_error":
        return RunCodeResponse(status="SandboxError", message=result.detail or "", loom_status=result.status)
    run_status: Literal["Finished", "Error", "TimeLimitExceeded"] = (
        "TimeLimitExceeded" if result.status == "timeout" else "Finished"
    )
    if result.status in ("memory", "output_limit", "killed"):
        run_status = "Error"
    return RunCodeResponse(
        status="Success" if result.status == "ok" else "Failed",
        message=result.detail or "",
        run_result=CommandRunResult(
            status=run_status,
            execution_time=result.wall_s,
            return_code=result.exit_code if result.exit_code is not None else (128 + (result.signal or 9)),
            stdout=result.stdout,
            stderr=result.stderr,
        ),
        loom_status=result.status,
    )
