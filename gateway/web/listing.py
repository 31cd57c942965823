"""The jobs and runs of one API key, newest first, for the run page's list (read-only SQLite)."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

LIST_LIMIT = 200


def owned_items(path: str | Path, owner: str, limit: int = LIST_LIMIT) -> dict[str, list[dict[str, Any]]]:
    """``{"runs": [...], "jobs": [...]}``: id, status, progress and times of ``owner``'s newest items."""
    with closing(sqlite3.connect(path, timeout=30.0)) as db:
        db.row_factory = sqlite3.Row
        runs = db.execute(
            "SELECT id, run_key AS key, status, completed_steps AS done, total_steps AS total, error,"
            " created_at, updated_at FROM runs WHERE owner=? ORDER BY created_at DESC LIMIT ?",
            (owner, limit),
        ).fetchall()
        jobs = db.execute(
            "SELECT j.id, j.job_key AS key, j.status, j.n_prompts AS total, j.error, j.created_at,"
            " j.updated_at, (SELECT COUNT(*) FROM job_groups g WHERE g.job_id=j.id) AS done"
            " FROM jobs j WHERE owner=? ORDER BY created_at DESC LIMIT ?",
            (owner, limit),
        ).fetchall()
    return {"runs": [dict(r) for r in runs], "jobs": [dict(r) for r in jobs]}
