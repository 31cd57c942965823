"""A few scored groups per run step, for the run page's sample browser (docs/run-page.md).

One row per (run, step) in the gateway's SQLite file (table ``run_samples``): the first
``SAMPLES_PER_STEP`` kept groups of the step, as ``ScoredGroup`` payloads (the shape ``/v1/jobs/{id}``
answers), and the step's mean of every reward component over ALL its kept trajectories (the run
page's per-component curves; the step metrics carry the total only). Written by the run loop after a
step is recorded; a step written twice (a resumed gateway) keeps its first row.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from contextlib import closing
from pathlib import Path
from statistics import fmean
from typing import Any

from loom.contracts.wire import Group, RewardResult

SAMPLES_PER_STEP = 2

SCHEMA = """
CREATE TABLE IF NOT EXISTS run_samples (
  run_id TEXT NOT NULL, step INTEGER NOT NULL, components TEXT NOT NULL, groups TEXT NOT NULL,
  PRIMARY KEY (run_id, step));
"""


def component_means(kept: Sequence[tuple[Group, RewardResult] | None]) -> dict[str, float]:
    """Each reward component's mean over the kept trajectories that report it. Pure."""
    values: dict[str, list[float]] = {}
    for item in kept:
        if item is None:
            continue
        for r in item[1].rewards:
            for name, v in r.components.items():
                values.setdefault(name, []).append(float(v))
    return {name: fmean(v) for name, v in sorted(values.items())}


def scored_groups(kept: Sequence[tuple[Group, RewardResult] | None], limit: int) -> list[dict[str, Any]]:
    """The first ``limit`` kept groups as ScoredGroup payloads (``index`` = position in the step)."""
    out: list[dict[str, Any]] = []
    for i, item in enumerate(kept):
        if item is None:
            continue
        if len(out) >= limit:
            break
        out.append(
            {"index": i, "group": item[0].model_dump(mode="json"), "rewards": item[1].model_dump(mode="json")}
        )
    return out


def _connect(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(path, timeout=30.0, isolation_level=None)
    db.row_factory = sqlite3.Row
    db.executescript(SCHEMA)
    return db


def store_samples(
    path: str | Path,
    run_id: str,
    step: int,
    kept: Sequence[tuple[Group, RewardResult] | None],
    limit: int = SAMPLES_PER_STEP,
) -> None:
    """Record step ``step``'s component means and first ``limit`` groups (kept if already there)."""
    with closing(_connect(Path(path))) as db:
        db.execute(
            "INSERT OR IGNORE INTO run_samples (run_id, step, components, groups) VALUES (?, ?, ?, ?)",
            (run_id, step, json.dumps(component_means(kept)), json.dumps(scored_groups(kept, limit))),
        )


def run_components(path: str | Path, run_id: str, after: int = -1) -> dict[int, dict[str, float]]:
    """step -> component means, for the steps after ``after``."""
    with closing(_connect(Path(path))) as db:
        rows = db.execute(
            "SELECT step, components FROM run_samples WHERE run_id=? AND step>? ORDER BY step",
            (run_id, after),
        ).fetchall()
    return {int(r["step"]): json.loads(r["components"]) for r in rows}


def run_samples(
    path: str | Path, run_id: str, step: int | None = None
) -> tuple[int | None, list[dict[str, Any]]]:
    """(step, its ScoredGroup payloads): of ``step``, or of the last step stored when None."""
    with closing(_connect(Path(path))) as db:
        if step is None:
            row = db.execute(
                "SELECT step, groups FROM run_samples WHERE run_id=? ORDER BY step DESC LIMIT 1", (run_id,)
            ).fetchone()
        else:
            row = db.execute(
                "SELECT step, groups FROM run_samples WHERE run_id=? AND step=?", (run_id, step)
            ).fetchone()
    if row is None:
        return step, []
    return int(row["step"]), json.loads(row["groups"])
