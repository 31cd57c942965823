"""The torch engine in its own process (ProcessEngine): what crosses the pipe besides generation.

Generation itself runs the whole engine contract in test_engines.py / test_modes.py (the ``engine``
and ``local_engine`` fixtures include it). Here: policy loads, typed errors, stats, a child that dies
(calls in flight fail typed, the next call starts a new child), a parent that dies (its child ends),
and cancelled calls.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from loom.contracts.wire import PolicyVersion, SamplingParams
from rollout_svc.engines.base import (
    EngineRequestError,
    EngineTimeout,
    EngineUnavailable,
    InvalidPrompt,
    PolicyLoadError,
)
from rollout_svc.engines.process import ProcessEngine
from rollout_svc.engines.torch import load_model, teacher_forced_logprobs

REPO = Path(__file__).resolve().parents[2]
ATOL = 1e-4

DEVICE = os.environ.get("LOOM_TEST_DEVICE", "cpu")  # the conftest engines' device


def ids_of(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def wait_gone(pid: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def own_engine(model_dir: Path) -> Any:
    engine = ProcessEngine(model_dir, cache_entries=8, device=DEVICE)
    yield engine
    engine.close_sync()


def test_stats_follow_the_child(own_engine: Any, model_dir: Path, arun: Any) -> None:
    """After every reply the parent's ``stats`` are the child's: the counts an in-process engine
    keeps for the same calls (bench/tree.py reads them)."""
    from rollout_svc.engines.torch import TorchEngine

    def counts(engine: Any) -> tuple[int, int, int, int]:
        s = engine.stats
        return s.prefill_tokens, s.cached_tokens, s.decode_tokens, s.requests

    local = TorchEngine(model_dir, cache_entries=8, device=DEVICE)
    deltas = []
    for engine in (own_engine, local):
        arun(engine.reset_cache())
        before = counts(engine)
        arun(engine.generate([5, 6, 7, 8], SamplingParams(n=3, max_tokens=10, seed=2)))
        arun(engine.generate([5, 6, 7, 8, 9], SamplingParams(max_tokens=3, seed=2)))
        deltas.append([b - a for a, b in zip(before, counts(engine), strict=True)])
    assert deltas[0] == deltas[1]
    prefill, cached, decode, requests = deltas[0]
    assert (prefill, cached, requests) == (5, 4, 2) and decode > 0


def test_policy_load_crosses_the_pipe(own_engine: Any, model_dir: Path, tmp_path: Path, arun: Any) -> None:
    model = load_model(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(str(tmp_path / "v3"))
    ids = ids_of(own_engine.tokenizer, "policy")
    params = SamplingParams(n=2, max_tokens=12, seed=5, temperature=1.0)
    before = arun(own_engine.generate(ids, params))
    arun(own_engine.load_policy(PolicyVersion(version=3, path=str(tmp_path / "v3"))))
    assert own_engine.policy_version == 3
    after = arun(own_engine.generate(ids, params))
    for c in after:  # exact against the NEW weights
        ref = teacher_forced_logprobs(model, ids + c.token_ids, len(ids))
        assert c.logprobs == pytest.approx(ref, abs=ATOL)
    assert [c.logprobs for c in after] != [c.logprobs for c in before]


def test_errors_keep_their_type(own_engine: Any, arun: Any) -> None:
    # the torch engine serves LoRA versions (merged, tests/learner/test_lora.py): a missing adapter
    # is a PolicyLoadError across the process boundary
    with pytest.raises(PolicyLoadError, match="adapter_config.json is missing"):
        arun(own_engine.load_policy(PolicyVersion(version=1, path="/nowhere", kind="lora")))
    from rollout_svc.engines.base import Layout

    with pytest.raises(ValueError, match="layout has 1 groups for 3 prompt tokens"):
        arun(own_engine.generate([5, 6, 7], SamplingParams(max_tokens=2), Layout(groups=[0])))
    # the engine still serves after both
    assert len(arun(own_engine.generate([5, 6, 7], SamplingParams(max_tokens=2, seed=1)))) == 1


def test_bad_input_is_typed_bad_input_across_the_pipe(own_engine: Any, arun: Any, tmp_path: Path) -> None:
    """A prompt outside the vocabulary and a path that is no checkpoint come back as the engine's
    request errors (422 at the API, no retry in a task), not as IndexError / ValueError."""
    with pytest.raises(InvalidPrompt, match="vocabulary") as e:
        arun(own_engine.generate([99999], SamplingParams(max_tokens=2)))
    assert e.value.field == "prompt_ids" and isinstance(e.value, EngineRequestError)
    before = own_engine.policy_version
    with pytest.raises(PolicyLoadError, match="could not load policy"):
        arun(own_engine.load_policy(PolicyVersion(version=before + 1, path=str(tmp_path))))
    assert own_engine.policy_version == before
    assert own_engine.vocab_size is not None and own_engine.max_model_len == 1024  # the child's model
    assert len(arun(own_engine.generate([5, 6, 7], SamplingParams(max_tokens=2, seed=1)))) == 1


def test_a_dead_child_fails_calls_in_flight_typed_and_the_next_call_restarts_it(
    own_engine: Any, torch_engine: Any, arun: Any
) -> None:
    ids = ids_of(own_engine.tokenizer, "restart")
    params = SamplingParams(n=2, max_tokens=16, seed=9)
    arun(own_engine.generate(ids, params))
    pid, restarts = own_engine.pid, own_engine.restarts

    async def killed_mid_call() -> None:
        # a call that cannot end early (no EOS) and is in flight when the child dies: a fixed sleep
        # raced a fast machine, where the call had already returned (CI, 2026-11-28)
        long = params.model_copy(update={"max_tokens": 400, "ignore_eos": True})
        call = asyncio.ensure_future(own_engine.generate(ids, long))
        while not own_engine._pending:
            await asyncio.sleep(0.001)
        os.kill(pid, signal.SIGKILL)
        await call

    with pytest.raises(EngineUnavailable, match="exited with code -9"):
        arun(killed_mid_call())
    assert wait_gone(pid)
    again = arun(own_engine.generate(ids, params))
    assert own_engine.pid != pid and own_engine.restarts == restarts + 1
    # a new child comes up with the base model (version 0; a rollout's catch-up reloads what it needs)
    assert own_engine.policy_version == 0
    base = arun(torch_engine.generate(ids, params))
    assert [c.token_ids for c in again] == [c.token_ids for c in base]
    assert not own_engine._pending


def test_a_hung_engine_process_is_a_typed_timeout_not_a_hang(model_dir: Path, arun: Any) -> None:
    engine = ProcessEngine(model_dir, cache_entries=4, timeout_s=1.0)
    try:
        assert len(arun(engine.generate([5, 6, 7], SamplingParams(max_tokens=2, seed=1)))) == 1
        assert engine.pid is not None
        os.kill(engine.pid, signal.SIGSTOP)  # alive, answering nothing
        t0 = time.monotonic()
        with pytest.raises(EngineTimeout, match="did not answer generate in 1 s"):
            arun(engine.generate([5, 6, 7], SamplingParams(max_tokens=2, seed=1)))
        assert time.monotonic() - t0 < 10
        os.kill(engine.pid, signal.SIGCONT)
        assert len(arun(engine.generate([5, 6, 7], SamplingParams(max_tokens=2, seed=1)))) == 1
        assert not engine._pending and engine.restarts == 0
    finally:
        if engine.pid is not None:
            os.kill(engine.pid, signal.SIGCONT)
        engine.close_sync()


def test_a_cancelled_call_leaves_nothing_behind(own_engine: Any, arun: Any) -> None:
    ids = ids_of(own_engine.tokenizer, "cancel")

    async def cancel_one() -> None:
        long = SamplingParams(n=4, max_tokens=300, seed=1, ignore_eos=True)  # cannot end before the cancel
        call = asyncio.ensure_future(own_engine.generate(ids, long))
        while not own_engine._pending:
            await asyncio.sleep(0.001)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call

    arun(cancel_one())
    assert not own_engine._pending
    outs = arun(own_engine.generate(ids, SamplingParams(max_tokens=4, seed=3)))
    assert len(outs) == 1 and not own_engine._pending


def test_a_forked_process_starts_its_own_engine_process(own_engine: Any, arun: Any) -> None:
    """Celery's prefork children are forks: one must not talk over its parent's socket."""
    arun(own_engine.generate([5, 6, 7], SamplingParams(max_tokens=2, seed=1)))
    pid = own_engine.pid
    r, w = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the forked process reports through the pipe
        code = b"E"
        try:
            outs = asyncio.run(own_engine.generate([5, 6, 7], SamplingParams(max_tokens=3, seed=1)))
            code = b"1" if own_engine.pid not in (None, pid) and len(outs) == 1 else b"0"
        finally:
            os.write(w, code)
            os._exit(0)
    os.close(w)
    got = os.read(r, 1)
    os.close(r)
    os.waitpid(child, 0)
    assert got == b"1"
    assert own_engine.pid == pid  # the parent's engine process is untouched and still serves
    assert len(arun(own_engine.generate([5, 6, 7], SamplingParams(max_tokens=3, seed=1)))) == 1


def test_the_child_ends_with_its_parent(model_dir: Path) -> None:
    code = (
        "import sys, time\n"
        "from rollout_svc.engines.process import ProcessEngine\n"
        f"e = ProcessEngine({str(model_dir)!r})\n"
        "print(e.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=REPO,
        stdout=subprocess.PIPE,
        env={**os.environ, "LOOM_TORCH_THREADS": "1"},
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert psutil.pid_exists(child)
        parent.kill()  # SIGKILL: no atexit, no close
        parent.wait()
        assert wait_gone(child), "the engine process outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()


def test_a_child_that_cannot_load_its_model_is_a_typed_error_and_leaves_nothing(
    model_dir: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)  # the tokenizer loads in the parent; the weights do not
    (broken / "model.safetensors").write_bytes(b"not a checkpoint")
    me = psutil.Process()

    def engine_children() -> set[int]:  # other tests' engines may be running: compare, not count
        pids = set()
        for c in me.children():
            try:  # other tests' ended processes may be zombies of this one (a sandbox pool adopts orphans)
                if "rollout_svc.engines.process" in " ".join(c.cmdline()):
                    pids.add(c.pid)
            except psutil.Error:
                continue
        return pids

    fds, children = me.num_fds(), engine_children()
    with pytest.raises(EngineUnavailable, match="engine start failed"):
        ProcessEngine(broken)
    assert me.num_fds() == fds  # the socket to the failed child is closed
    assert engine_children() == children  # and the child is reaped
