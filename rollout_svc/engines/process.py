"""The torch engine in its own process: an engine core process, as vLLM V1 runs its EngineCore.

Why: a rollout worker that holds the torch engine in its own process shares one GIL between the
engine's scheduler thread and everything else the worker does for a group (Celery's trace, message
decoding, the result store, the ack, hand-offs between threads). Measured with ``bench/rollout.py``
on 2 cores: that cost the in-process engine 8-16 % at 4 groups in flight, against 2-6 % for the same
worker calling an engine server. ``ProcessEngine`` keeps the in-process engine's whole interface
(group layouts, attention scores, prefix cache, policy loads, ``stats``) and runs the model in a
child process: the worker's Python and the engine's then use two cores, not one GIL.

Wire: one socket pair, ``multiprocessing.connection`` framing (pickle: the pair is unnamed and only
the two processes hold its ends; nothing on a network ever reaches it). The parent sends
``(id, method, args)``; the child answers ``(id, ok, value_or_exception, state)`` with ``state`` =
(policy version, stats, (vocab size, context length)), so ``policy_version``, ``stats`` and the
model's limits (``vocab_size``, ``max_model_len``) are current after every reply. The child
runs the requests concurrently on its own event loop (the torch engine's scheduler batches
concurrent ``generate`` calls, exactly as in-process); a cancelled call is cancelled in the child.

Timeout: a ``generate`` or ``score_attention`` call that gets no answer within ``timeout_s``
(``LOOM_ENGINE_TIMEOUT_S``, as for an engine server) fails with ``EngineTimeout`` and is cancelled in
the child: a hung engine is a typed error, never a hung task.

Failure: the child exits when its parent dies (end of file on the socket). If the child dies, every
call in flight fails with ``EngineUnavailable`` (typed, retried by the rollout task) and the next call
starts a new child, which comes up with the base model: the rollout's catch-up then loads the policy
version a group needs, as after any engine restart.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import concurrent.futures
import contextlib
import itertools
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import asdict
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Literal

from loom.contracts.wire import PolicyVersion, SamplingParams
from rollout_svc.engines.base import (
    Completion,
    Engine,
    EngineError,
    EngineStats,
    EngineTimeout,
    EngineUnavailable,
    Layout,
    PromptLogprobs,
)
from rollout_svc.engines.torch import TorchEngine, load_tokenizer

log = logging.getLogger("loom.engine.process")

_CHILDREN: weakref.WeakSet[ProcessEngine] = weakref.WeakSet()


@atexit.register
def _stop_children() -> None:
    for engine in list(_CHILDREN):
        engine.close_sync()


def _forget_children() -> None:
    for engine in list(_CHILDREN):
        engine._forget()


# A forked process (Celery's prefork children) must not share its parent's engine process: it drops
# the inherited socket (else the engine would outlive a dead parent while a fork still held it) and
# starts its own on its first call.
os.register_at_fork(after_in_child=_forget_children)


class ProcessEngine(Engine):
    name = TorchEngine.name  # the same engine, in another process
    capabilities = TorchEngine.capabilities
    batches_loras = True  # the child is a torch engine: LoRA versions beside its base (``lora_view``)

    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str = "cpu",
        cache_entries: int = 32,
        logprobs_mode: Literal["raw", "processed"] = "raw",
        dtype: str = "float32",
        start_timeout_s: float = 120.0,
        timeout_s: float | None = None,
        **lora: int,
    ) -> None:
        super().__init__()
        self.model_path = Path(model_path)
        self.logprobs_kind = logprobs_mode
        self._config = {  # TorchEngine's arguments in the child
            "model_path": str(self.model_path),
            "device": device,
            "cache_entries": cache_entries,
            "logprobs_mode": logprobs_mode,
            "dtype": dtype,
            **lora,  # the LRU bounds: max_loras, lora_bytes, versions_bytes (engines.lora_settings)
        }
        self.start_timeout_s = start_timeout_s
        self.timeout_s = timeout_s
        self.tokenizer = load_tokenizer(self.model_path)
        self._lock = threading.Lock()  # the child, the socket's send side and the pending table
        self._ids = itertools.count(1)
        self._pending: dict[int, concurrent.futures.Future[Any]] = {}
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._closed = False
        self.restarts = 0
        self._limits: tuple[int | None, int | None] = (None, None)  # the child model's, from its state
        _CHILDREN.add(self)
        with self._lock:
            self._start()

    # ---------------------------------------------------------------------------------------------
    # the child

    def _forget(self) -> None:
        """In a forked process: the parent's child, socket and reader thread stay the parent's."""
        self._lock = threading.Lock()
        self._pending = {}
        conn, self._conn, self._proc = self._conn, None, None
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.close()

    def _ensure_started(self) -> None:
        with self._lock:
            if self._conn is None and not self._closed:
                self._restart()

    def _restart(self) -> None:
        """A new child after the last one ended (caller holds ``_lock``)."""
        self.restarts += 1
        log.warning("starting a new torch engine process (restart %d)", self.restarts)
        self._start()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def _start(self) -> None:
        """Start a child and wait for its model (caller holds ``_lock``)."""
        parent_sock, child_sock = socket.socketpair()
        argv = [sys.executable, "-m", "rollout_svc.engines.process", "--fd", str(child_sock.fileno())]
        try:
            proc = subprocess.Popen(argv, pass_fds=[child_sock.fileno()], stdin=subprocess.DEVNULL)
        finally:
            child_sock.close()
        conn = Connection(parent_sock.detach())
        try:
            conn.send(self._config)
            self._await_ready(proc, conn)
        except BaseException:  # a child that failed to start leaves no process and no socket behind
            conn.close()
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            raise
        self._proc, self._conn = proc, conn
        threading.Thread(target=self._read, args=(proc, conn), name="loom-engine-reader", daemon=True).start()
        log.info("torch engine process %d is up (%s)", proc.pid, self.model_path)

    def _await_ready(self, proc: subprocess.Popen[bytes], conn: Connection) -> None:
        """The child's first message: its model is loaded (and its state), or why it is not."""
        deadline = time.monotonic() + self.start_timeout_s
        while not conn.poll(0.2):
            if proc.poll() is not None or time.monotonic() > deadline:
                why = "no answer" if proc.returncode is None else f"exit code {proc.returncode}"
                raise EngineUnavailable(
                    f"the torch engine process did not start ({why}, {self.start_timeout_s:.0f} s "
                    "allowed); see its log above"
                )
        try:
            _, ok, value, state = conn.recv()
        except (EOFError, OSError) as e:
            raise EngineUnavailable(f"the torch engine process died while starting: {e!r}") from e
        if not ok:
            raise value
        self._apply_state(state)

    def _apply_state(
        self, state: tuple[tuple[int, str | None], dict[str, Any], tuple[int | None, int | None]]
    ) -> None:
        (version, namespace), stats, limits = state
        self.policy_version, self.policy_namespace = version, namespace
        self.stats = EngineStats(**stats)
        self._limits = limits

    @property
    def vocab_size(self) -> int | None:
        return self._limits[0]

    @property
    def max_model_len(self) -> int | None:
        return self._limits[1]

    def _read(self, proc: subprocess.Popen[bytes], conn: Connection) -> None:
        """The reader thread of one child: resolves replies; on the child's end fails what is pending."""
        while True:
            try:
                rid, ok, value, state = conn.recv()
            except (EOFError, OSError):
                break
            self._apply_state(state)
            with self._lock:
                fut = self._pending.pop(rid, None)
            if fut is None or fut.done():
                continue
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                if ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(value)
        code = proc.wait()
        with self._lock:
            if self._conn is conn:
                self._conn, self._proc = None, None
                conn.close()
            stranded = list(self._pending.values())
            self._pending.clear()
        if not self._closed:
            log.error("torch engine process %d exited with code %s", proc.pid, code)
        for fut in stranded:
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                fut.set_exception(EngineUnavailable(f"the torch engine process exited with code {code}"))

    def _call(self, method: str, *args: Any) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise EngineUnavailable("the engine is closed")
            if self._conn is None:  # normally started by _ask off the event loop; a race lands here
                self._restart()
            rid = next(self._ids)
            self._pending[rid] = fut
            assert self._conn is not None
            try:
                self._conn.send((rid, method, args))
            except OSError as e:  # the child is gone: its reader fails the pending calls
                self._pending.pop(rid, None)
                raise EngineUnavailable(f"the torch engine process is gone: {e!r}") from e
            conn = self._conn

        def cancelled(f: concurrent.futures.Future[Any]) -> None:
            if f.cancelled():
                with self._lock:
                    self._pending.pop(rid, None)
                    if self._conn is conn:
                        with contextlib.suppress(OSError):
                            conn.send((rid, "cancel", ()))

        fut.add_done_callback(cancelled)
        return fut

    async def _ask(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        if self._conn is None:  # (re)start the child without blocking the event loop for seconds
            await asyncio.to_thread(self._ensure_started)
        call = asyncio.wrap_future(self._call(method, *args))
        if timeout is None:
            return await call
        try:
            return await asyncio.wait_for(call, timeout)  # on expiry the call is cancelled in the child
        except TimeoutError as e:
            raise EngineTimeout(
                f"the torch engine process did not answer {method} in {timeout:g} s (LOOM_ENGINE_TIMEOUT_S)"
            ) from e

    # ---------------------------------------------------------------------------------------------
    # interface

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, layout: Layout | None = None
    ) -> list[Completion]:
        return await self._ask("generate", list(prompt_ids), params, layout, timeout=self.timeout_s)  # type: ignore[no-any-return]

    async def load_policy(self, policy: PolicyVersion) -> None:
        await self._ask("load_policy", policy)

    async def lora_view(self, policy: PolicyVersion) -> Engine | None:
        """The LoRA version ``policy`` served by the child's engine beside its base, in its batches
        (``torch.lora``): the view's calls name the version, the child serves them by its own view."""
        return _LoraCalls(self, policy)

    async def reset_cache(self) -> None:
        await self._ask("reset_cache")

    async def score_attention(
        self, token_ids: list[int], steps: list[tuple[int, int]], delta: int = 4, zero_from: int | None = None
    ) -> list[float]:
        args = (list(token_ids), list(steps), delta, zero_from)
        return await self._ask("score_attention", *args, timeout=self.timeout_s)  # type: ignore[no-any-return]

    async def prompt_logprobs(self, token_ids: list[int], k: int) -> PromptLogprobs:
        return await self._ask("prompt_logprobs", list(token_ids), k, timeout=self.timeout_s)  # type: ignore[no-any-return]

    async def close(self) -> None:
        await asyncio.to_thread(self.close_sync)

    def close_sync(self, timeout: float = 5.0) -> None:
        with self._lock:
            self._closed = True
            proc, conn = self._proc, self._conn
        if proc is None or conn is None:
            return
        with contextlib.suppress(OSError):
            conn.send((0, "shutdown", ()))
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class _LoraCalls(Engine):
    """A LoRA version of a ``ProcessEngine``'s child (``ProcessEngine.lora_view``)."""

    def __init__(self, parent: ProcessEngine, policy: PolicyVersion) -> None:
        super().__init__()
        self.parent, self.policy = parent, policy
        self.name, self.capabilities = parent.name, parent.capabilities
        self.logprobs_kind = parent.logprobs_kind
        self.policy_version, self.policy_namespace = policy.version, policy.namespace
        self.stats = parent.stats

    @property
    def vocab_size(self) -> int | None:
        return self.parent.vocab_size

    @property
    def max_model_len(self) -> int | None:
        return self.parent.max_model_len

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, layout: Layout | None = None
    ) -> list[Completion]:
        args = ("generate", list(prompt_ids), params, layout)
        return await self.parent._ask("lora", self.policy, *args, timeout=self.parent.timeout_s)  # type: ignore[no-any-return]

    async def score_attention(
        self, token_ids: list[int], steps: list[tuple[int, int]], delta: int = 4, zero_from: int | None = None
    ) -> list[float]:
        args = ("score_attention", list(token_ids), list(steps), delta, zero_from)
        return await self.parent._ask("lora", self.policy, *args, timeout=self.parent.timeout_s)  # type: ignore[no-any-return]

    async def prompt_logprobs(self, token_ids: list[int], k: int) -> PromptLogprobs:
        args = ("prompt_logprobs", list(token_ids), k)
        return await self.parent._ask("lora", self.policy, *args, timeout=self.parent.timeout_s)  # type: ignore[no-any-return]

    async def load_policy(self, policy: PolicyVersion) -> None:
        raise EngineError("a LoRA version's calls serve that version only")

    async def reset_cache(self) -> None:
        await self.parent.reset_cache()


async def _lora_call(engine: Any, policy: PolicyVersion, method: str, *args: Any) -> Any:
    """The child's side of ``_LoraCalls``: ``method`` of the engine's view of ``policy``."""
    view = await engine.lora_view(policy)
    if view is None:
        raise EngineError("this engine does not serve LoRA versions beside its base")
    if method not in {"generate", "score_attention", "prompt_logprobs"}:
        raise EngineError(f"unknown engine method {method!r}")
    return await getattr(view, method)(*args)


# -------------------------------------------------------------------------------------------------
# the child process


def _picklable(e: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(e))  # noqa: S301 (our own object, round-tripped)
        return e
    except Exception:
        return EngineError(f"{type(e).__name__}: {e}")


def _state(engine: Any) -> tuple[tuple[int, str | None], dict[str, Any], tuple[int | None, int | None]]:
    policy = (engine.policy_version, engine.policy_namespace)
    return policy, asdict(engine.stats), (engine.vocab_size, engine.max_model_len)


async def _serve(conn: Connection, engine: Any) -> None:
    loop = asyncio.get_running_loop()
    tasks: dict[int, asyncio.Task[Any]] = {}
    send_lock = threading.Lock()

    def state() -> tuple[tuple[int, str | None], dict[str, Any], tuple[int | None, int | None]]:
        return _state(engine)

    def reply(rid: int, ok: bool, value: Any) -> None:
        with send_lock:
            conn.send((rid, ok, value, state()))

    async def handle(rid: int, method: str, args: tuple[Any, ...]) -> None:
        try:
            if method == "lora":
                value = await _lora_call(engine, *args)
            else:
                value = await getattr(engine, method)(*args)
        except asyncio.CancelledError:
            return
        except Exception as e:
            reply(rid, False, _picklable(e))
        else:
            reply(rid, True, value)
        finally:
            tasks.pop(rid, None)

    methods = {"generate", "load_policy", "reset_cache", "score_attention", "prompt_logprobs", "lora"}
    while True:
        try:
            rid, method, args = await loop.run_in_executor(None, conn.recv)
        except (EOFError, OSError):
            return  # the parent is gone
        if method == "shutdown":
            return
        if method == "cancel":
            task = tasks.get(rid)
            if task is not None:
                task.cancel()
            continue
        if method not in methods:
            reply(rid, False, EngineError(f"unknown engine method {method!r}"))
            continue
        tasks[rid] = asyncio.create_task(handle(rid, method, args))


def child_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="the torch engine process of a ProcessEngine (not for users)")
    p.add_argument("--fd", type=int, required=True)
    a = p.parse_args(argv)
    from loom.runtime import configure_process

    configure_process()
    conn = Connection(a.fd)
    config = conn.recv()
    try:
        engine = TorchEngine(**config)
    except Exception as e:
        log.exception("the torch engine process could not load its model")
        failed = _picklable(EngineUnavailable(f"engine start failed: {e!r}"))
        conn.send((0, False, failed, (0, {}, (None, None))))
        return 1
    conn.send((0, True, None, _state(engine)))
    log.info("torch engine process %d serving %s", os.getpid(), config["model_path"])
    try:
        asyncio.run(_serve(conn, engine))
    finally:
        engine.stop_scheduler()
    return 0


if __name__ == "__main__":
    raise SystemExit(child_main())
