"""``python``: the code sandbox as a stateful interpreter (docs/environments.md, docs/sandbox.md).

``reset`` opens one sandbox interpreter session (``loom.clients.sandbox_session``, the sandbox
service's HTTP API at ``LOOM_ENV_SANDBOX_URL`` or the settings' sandbox port); each step runs its tool
call's ``code`` argument as one cell, so variables live from turn to turn; ``close`` ends the session.
The observation is the cell's status and output, cut to ``max_output_chars``; a session the sandbox
lost or never opened is such an observation too (``[session_lost]``, ``[sandbox_error]``). A turn
without a tool call is the policy's answer: the episode is done. Rewards are the reward service's.
"""

from __future__ import annotations

from pydantic import Field

from env_svc.config import get_env_settings
from loom.clients.sandbox_session import SandboxSessionClient, ToolSession
from loom.contracts.envs import EnvAction, EnvReset, EnvStep, EnvTask
from loom.contracts.sandbox import CallResult, Limits, SessionLimits
from loom.contracts.wire import Contract


class PythonOptions(Contract):
    tool: str = Field(default="python", max_length=64, description="the tool name whose calls run")
    limits: Limits = Field(default_factory=Limits, description="each cell's limits")
    session: SessionLimits = Field(default_factory=SessionLimits)
    max_output_chars: int = Field(default=4000, ge=64, le=100_000)


def render(result: CallResult, cap: int) -> str:
    """``[status]`` and the cell's stdout and stderr, the tail kept when over ``cap`` characters."""
    out = result.stdout + (("\n" if result.stdout else "") + result.stderr if result.stderr else "")
    if result.status != "ok" and result.detail:
        out += ("\n" if out else "") + result.detail
    if len(out) > cap:
        out = f"... [{len(out) - cap} characters cut]\n" + out[-cap:]
    return f"[{result.status}]\n{out}".rstrip("\n")


class PythonEnv:
    # replayable: the same cells rerun in a fresh session answer the same as far as they are
    # deterministic; a tree checks every replayed output (a seedless random, the clock, set order
    # under hash randomization, a timeout's race differ: env_replay_mismatch, never a wrong episode)
    replayable = True

    def __init__(self, client: SandboxSessionClient | None = None) -> None:
        self.client = client or SandboxSessionClient(get_env_settings().sandbox_url or None)
        self.session: ToolSession | None = None
        self.opts = PythonOptions()

    def reset(self, task: EnvTask) -> EnvReset:
        self.opts = PythonOptions.model_validate(task.options)
        self.session = self.client.session(self.opts.limits, self.opts.session)
        info = self.session.info
        if not info.alive:
            return EnvReset(status="env_error", error=f"no sandbox session: {info.ended}")
        return EnvReset(meta={"session": info.id})

    def step(self, action: EnvAction) -> EnvStep:
        call = action.tool_call
        if call is None:
            return EnvStep(done=True, meta={"answered": True})
        code = call.arguments.get("code", call.arguments.get("input"))
        if call.name != self.opts.tool or not isinstance(code, str):
            text = f"error: call the {self.opts.tool} tool with a string argument 'code'"
            return EnvStep(observation=text, meta={"sandbox_status": "bad_call"})
        assert self.session is not None, "step before reset"
        result = self.session.run(code)
        return EnvStep(
            observation=render(result, self.opts.max_output_chars),
            meta={"sandbox_status": result.status, "alive": result.session.alive},
        )

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
        self.client.close()
