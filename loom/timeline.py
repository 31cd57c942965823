"""An opt-in timeline of work through the queue path: where a job's time goes.

With ``LOOM_TIMELINE=<file>`` in its environment, every Loom process appends one JSON line per mark
to that file: ``{"t": <time.time()>, "pid": ..., "event": ..., "key": ..., **extra}``. Without it a
mark costs one attribute read. The marks along one job (docs/benchmarks/trl-rollout.md): the gateway's
``publish``/``published`` per task and ``result`` when a task's result reaches it (gateway/pipeline.py),
``stored`` per job group (gateway/jobs.py), ``sent`` per event-stream group (gateway/routes/jobs.py);
the embedded broker's ``claim`` (a worker leased the task's message; loom/embedded_broker.py);
the rollout worker's ``task_start``, ``engine_call``, ``engine_done``, ``task_end``
(rollout_svc/tasks.py); the engine process's ``admit`` and ``batch_end`` (the torch scheduler); the
reward worker's ``score_start``/``score_end`` per group and ``batch_start`` per ``reward.score_groups``
task (reward_svc/tasks.py). ``bench/trl_overhead.py
--timeline`` reads them back. One line is one ``write`` on a file opened for appending, so lines of
several processes do not interleave.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

PATH = os.environ.get("LOOM_TIMELINE") or None
_lock = threading.Lock()


def mark(event: str, key: str = "", **extra: Any) -> None:
    """Record ``event`` for ``key`` now (nothing without ``LOOM_TIMELINE``)."""
    if PATH is None:
        return
    line = json.dumps({"t": time.time(), "pid": os.getpid(), "event": event, "key": key, **extra})
    with _lock:
        fd = os.open(PATH, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)


def read(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The marks of a timeline file, in time order."""
    try:
        with open(path) as f:
            marks = [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []
    return sorted(marks, key=lambda m: m["t"])
