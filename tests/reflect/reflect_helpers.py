"""Helpers of the reflect tests: ``serve`` (an ASGI app on a free port in a uvicorn thread, stopped
on exit), the tiny tokenizer's exact decoder, and reflective traces as token trajectories."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serve(app: Any) -> Iterator[str]:
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def decoder(tok: Any) -> Any:
    return lambda ids: tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def trace_group(
    tok: Any, kind: str = "arith", n: int = 3, seed: int = 5, gid: str = "g", wrong: tuple[int, ...] = ()
) -> Any:
    """One problem's group of reflective traces (Loom's generator) as token trajectories; the
    trajectories in ``wrong`` state a wrong answer everywhere (arith only)."""
    import random

    from loom.contracts.wire import Group, Trajectory
    from zoo.tiny import tiny_problems
    from zoo.tiny.traces import reflect_trace

    p0 = tiny_problems(kind, 1, seed, "test")[0]  # type: ignore[arg-type]
    trajs = []
    for i in range(n):
        prompt, completion = reflect_trace(p0, random.Random(i))
        text = completion.text
        if i in wrong:
            text = text.replace(p0.gold, str(int(p0.gold) + 1))
        ids = tok.encode(text, add_special_tokens=False)
        trajs.append(
            Trajectory(
                id=f"t{i}",
                group_id=gid,
                prompt_ids=tok.encode(prompt.text, add_special_tokens=False),
                completion_ids=ids,
                logprobs=[-0.5] * len(ids),
                text=text,
            )
        )
    label = p0.gold
    meta: dict[str, Any] = {}
    task = "arithmetic"
    if kind == "countdown":
        task = "countdown"
        meta = {"numbers": list(p0.numbers), "target": p0.target}
    return Group(id=gid, prompt=prompt.text, label=label, task=task, meta=meta, trajectories=trajs)  # type: ignore[arg-type]
