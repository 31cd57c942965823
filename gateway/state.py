"""Durable gateway state in SQLite (``<data_dir>/gateway.sqlite``): jobs, their scored groups, runs,
their step plans and completed steps. Every state change is one transaction, so a killed gateway
leaves either the old or the new state, never half of a step.

Uploaded datasets are owned: a ``datasets`` row per (key, dataset) says which keys stored which
content (the files themselves are shared, by content hash: gateway/datasets.py).

Each job and run records its cost (``samples``, ``tokens``: gateway/quotas.py); a submission is checked
against its key's quotas in the same transaction that inserts it, so concurrent submissions cannot
both slip under a limit.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gateway.quotas import Cost, Quotas, dataset_over_quota, over_quota

ACTIVE = ("queued", "running")

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
  id TEXT PRIMARY KEY, owner TEXT NOT NULL, job_key TEXT NOT NULL, status TEXT NOT NULL,
  request TEXT NOT NULL, n_prompts INTEGER NOT NULL, error TEXT, counters TEXT NOT NULL DEFAULT '{}',
  created_at REAL NOT NULL, updated_at REAL NOT NULL, UNIQUE(owner, job_key));
CREATE TABLE IF NOT EXISTS job_groups (
  job_id TEXT NOT NULL, idx INTEGER NOT NULL, seq INTEGER NOT NULL, payload TEXT NOT NULL,
  PRIMARY KEY (job_id, idx));
CREATE TABLE IF NOT EXISTS runs (
  id TEXT PRIMARY KEY, owner TEXT NOT NULL, run_key TEXT, status TEXT NOT NULL, config TEXT NOT NULL,
  completed_steps INTEGER NOT NULL DEFAULT 0, total_steps INTEGER NOT NULL,
  policy_version INTEGER NOT NULL, batch_size INTEGER NOT NULL, error TEXT,
  created_at REAL NOT NULL, updated_at REAL NOT NULL, UNIQUE(owner, run_key));
CREATE TABLE IF NOT EXISTS run_plans (
  run_id TEXT NOT NULL, step INTEGER NOT NULL, batch_size INTEGER NOT NULL, gen_version INTEGER NOT NULL,
  PRIMARY KEY (run_id, step));
CREATE TABLE IF NOT EXISTS run_steps (
  run_id TEXT NOT NULL, step INTEGER NOT NULL, metrics TEXT NOT NULL, PRIMARY KEY (run_id, step));
CREATE TABLE IF NOT EXISTS run_samples (
  run_id TEXT NOT NULL, step INTEGER NOT NULL, idx INTEGER NOT NULL, group_id TEXT NOT NULL,
  grp TEXT NOT NULL, rewards TEXT NOT NULL, PRIMARY KEY (run_id, step, idx));
CREATE TABLE IF NOT EXISTS datasets (
  owner TEXT NOT NULL, id TEXT NOT NULL, bytes INTEGER NOT NULL, n_items INTEGER NOT NULL,
  created_at REAL NOT NULL, PRIMARY KEY (owner, id));
"""
# columns added after the first release: added to an older database when it is opened
COST_COLUMNS = ("samples INTEGER NOT NULL DEFAULT 0", "tokens INTEGER NOT NULL DEFAULT 0")


class GatewayState:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        db = self._db()
        db.executescript(SCHEMA)
        for table in ("jobs", "runs"):
            have = {r["name"] for r in db.execute(f"PRAGMA table_info({table})")}
            for column in COST_COLUMNS:
                if column.split()[0] not in have:
                    db.execute(f"ALTER TABLE {table} ADD COLUMN {column}")

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
            db.row_factory = sqlite3.Row
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            self._local.db = db
        return db

    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        db = self._db()
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def data_version(self) -> int:
        """Changes when another connection commits (a cheap "anything new?" for event streams)."""
        return int(self._db().execute("PRAGMA data_version").fetchone()[0])

    def _check_quota(self, db: sqlite3.Connection, owner: str, kind: str, cost: Cost, quotas: Quotas) -> None:
        """Raise QuotaExceeded when ``cost`` does not fit beside ``owner``'s queued and running work."""
        marks = ",".join("?" * len(ACTIVE))
        held = [0, 0, 0, 0]  # jobs, runs, samples, tokens
        for i, table in enumerate(("jobs", "runs")):
            row = db.execute(
                f"SELECT COUNT(*), COALESCE(SUM(samples), 0), COALESCE(SUM(tokens), 0) FROM {table} "  # noqa: S608
                f"WHERE owner=? AND status IN ({marks})",
                (owner, *ACTIVE),
            ).fetchone()
            held[i] = int(row[0])
            held[2] += int(row[1])
            held[3] += int(row[2])
        problem = over_quota(kind, cost, quotas, jobs=held[0], runs=held[1], samples=held[2], tokens=held[3])
        if problem is not None:
            raise problem

    def _existing_or_admit(
        self,
        db: sqlite3.Connection,
        kind: str,
        owner: str,
        key: str | None,
        body: str,
        cost: Cost,
        quotas: Quotas | None,
    ) -> str | None:
        """The id of ``owner``'s job or run (``kind``) under idempotency ``key`` (KeyError when its
        request differs from ``body``); None when there is none and a new one fits ``quotas``
        (QuotaExceeded when it does not)."""
        table, body_column = ("jobs", "request") if kind == "job" else ("runs", "config")
        if key is not None:
            row = db.execute(
                f"SELECT id, {body_column} FROM {table} WHERE owner=? AND {kind}_key=?",  # noqa: S608
                (owner, key),
            ).fetchone()
            if row is not None:
                if row[body_column] != body:
                    raise KeyError(row["id"])
                return str(row["id"])
        if quotas is not None:
            self._check_quota(db, owner, kind, cost, quotas)
        return None

    # ------------------------------------------------------------------------------------------ jobs
    def create_job(
        self,
        owner: str,
        job_key: str,
        request: dict[str, Any],
        n_prompts: int,
        cost: Cost = Cost(0, 0),
        quotas: Quotas | None = None,
    ) -> tuple[str, bool]:
        """(job id, created); an existing (owner, job_key) returns its id and False. A new job over one of
        ``quotas`` (beside the owner's queued and running work) raises QuotaExceeded."""
        body = json.dumps(request, sort_keys=True)
        with self.tx() as db:
            existing = self._existing_or_admit(db, "job", owner, job_key, body, cost, quotas)
            if existing is not None:
                return existing, False
            job_id = "job-" + uuid.uuid4().hex[:16]
            now = time.time()
            db.execute(
                "INSERT INTO jobs (id, owner, job_key, status, request, n_prompts, samples, tokens,"
                " created_at, updated_at) VALUES (?, ?, ?, 'queued', ?, ?, ?, ?, ?, ?)",
                (job_id, owner, job_key, body, n_prompts, cost.samples, cost.tokens, now, now),
            )
            return job_id, True

    def job(self, job_id: str) -> dict[str, Any] | None:
        row = self._db().execute("SELECT * FROM jobs WHERE id=?", (job_id,)).fetchone()
        return dict(row) if row else None

    def jobs_with_status(self, *statuses: str) -> list[str]:
        marks = ",".join("?" * len(statuses))
        rows = self._db().execute(f"SELECT id FROM jobs WHERE status IN ({marks})", statuses).fetchall()  # noqa: S608
        return [str(r["id"]) for r in rows]

    def _set(self, table: str, item_id: str, fields: dict[str, Any]) -> None:
        fields["updated_at"] = time.time()
        cols = ", ".join(f"{k}=?" for k in fields)
        with self.tx() as db:
            db.execute(f"UPDATE {table} SET {cols} WHERE id=?", (*fields.values(), item_id))  # noqa: S608

    def set_job(self, job_id: str, **fields: Any) -> None:
        if "counters" in fields:
            fields["counters"] = json.dumps(fields["counters"])
        self._set("jobs", job_id, fields)

    def start_job(self, job_id: str) -> bool:
        """Mark the job running unless it ended meanwhile (a cancel); False if it did."""
        with self.tx() as db:
            cur = db.execute(
                "UPDATE jobs SET status='running', updated_at=? "
                "WHERE id=? AND status IN ('queued', 'running')",
                (time.time(), job_id),
            )
            return cur.rowcount > 0

    def finish(self, table: str, item_id: str, status: str, **fields: Any) -> bool:
        """Set a final ``status`` of a job or run (``table``) that is still queued or running: a cancel
        that came first is never overwritten by the end of the work it interrupted."""
        fields = {"status": status, "updated_at": time.time(), **fields}
        if "counters" in fields:
            fields["counters"] = json.dumps(fields["counters"])
        cols = ", ".join(f"{k}=?" for k in fields)
        with self.tx() as db:
            cur = db.execute(
                f"UPDATE {table} SET {cols} WHERE id=? AND status IN ('queued', 'running')",  # noqa: S608
                (*fields.values(), item_id),
            )
            return cur.rowcount > 0

    def cancelled_among(self, ids: list[str]) -> set[str]:
        """The jobs and runs among ``ids`` whose status is ``cancelled``."""
        out: set[str] = set()
        for i in range(0, len(ids), 500):
            part = ids[i : i + 500]
            marks = ",".join("?" * len(part))
            for table in ("jobs", "runs"):
                rows = self._db().execute(
                    f"SELECT id FROM {table} WHERE status='cancelled' AND id IN ({marks})",  # noqa: S608
                    part,
                )
                out.update(str(r["id"]) for r in rows)
        return out

    def add_job_group(self, job_id: str, idx: int, payload: dict[str, Any]) -> None:
        with self.tx() as db:
            seq = db.execute("SELECT COUNT(*) FROM job_groups WHERE job_id=?", (job_id,)).fetchone()[0]
            db.execute(
                "INSERT OR IGNORE INTO job_groups (job_id, idx, seq, payload) VALUES (?, ?, ?, ?)",
                (job_id, idx, seq, json.dumps(payload)),
            )

    def job_groups(self, job_id: str, after_seq: int = -1) -> list[tuple[int, dict[str, Any]]]:
        rows = (
            self._db()
            .execute(
                "SELECT seq, payload FROM job_groups WHERE job_id=? AND seq>? ORDER BY seq",
                (job_id, after_seq),
            )
            .fetchall()
        )
        return [(int(r["seq"]), json.loads(r["payload"])) for r in rows]

    def job_done_indices(self, job_id: str) -> set[int]:
        rows = self._db().execute("SELECT idx FROM job_groups WHERE job_id=?", (job_id,)).fetchall()
        return {int(r["idx"]) for r in rows}

    # ------------------------------------------------------------------------------------------ runs
    def create_run(
        self,
        owner: str,
        run_key: str | None,
        config: dict[str, Any],
        total: int,
        version: int,
        batch: int,
        cost: Cost = Cost(0, 0),
        quotas: Quotas | None = None,
    ) -> tuple[str, bool]:
        body = json.dumps(config, sort_keys=True)
        with self.tx() as db:
            existing = self._existing_or_admit(db, "run", owner, run_key, body, cost, quotas)
            if existing is not None:
                return existing, False
            run_id = "run-" + uuid.uuid4().hex[:16]
            now = time.time()
            db.execute(
                "INSERT INTO runs (id, owner, run_key, status, config, total_steps, policy_version,"
                " batch_size, samples, tokens, created_at, updated_at)"
                " VALUES (?, ?, ?, 'queued', ?, ?, ?, ?, ?, ?, ?, ?)",
                (run_id, owner, run_key, body, total, version, batch, cost.samples, cost.tokens, now, now),
            )
            return run_id, True

    def run(self, run_id: str) -> dict[str, Any] | None:
        row = self._db().execute("SELECT * FROM runs WHERE id=?", (run_id,)).fetchone()
        return dict(row) if row else None

    def runs_with_status(self, *statuses: str) -> list[str]:
        marks = ",".join("?" * len(statuses))
        rows = (
            self._db()
            .execute(
                f"SELECT id FROM runs WHERE status IN ({marks}) ORDER BY created_at",
                statuses,  # noqa: S608
            )
            .fetchall()
        )
        return [str(r["id"]) for r in rows]

    def set_run(self, run_id: str, **fields: Any) -> None:
        self._set("runs", run_id, fields)

    def start_run(self, run_id: str) -> bool:
        """Mark the run running unless it was cancelled meanwhile (atomically); False if cancelled."""
        with self.tx() as db:
            cur = db.execute(
                "UPDATE runs SET status='running', error=NULL, updated_at=? "
                "WHERE id=? AND status != 'cancelled'",
                (time.time(), run_id),
            )
            return cur.rowcount > 0

    def plan(self, run_id: str, step: int, batch_size: int, gen_version: int) -> tuple[int, int]:
        """The (batch size, generation policy version) of ``step``: the first plan recorded wins, so a
        resumed gateway regenerates exactly the same prompts with the same task keys."""
        with self.tx() as db:
            db.execute(
                "INSERT OR IGNORE INTO run_plans (run_id, step, batch_size, gen_version) VALUES (?, ?, ?, ?)",
                (run_id, step, batch_size, gen_version),
            )
            row = db.execute(
                "SELECT batch_size, gen_version FROM run_plans WHERE run_id=? AND step=?", (run_id, step)
            ).fetchone()
            return int(row["batch_size"]), int(row["gen_version"])

    def complete_step(
        self, run_id: str, step: int, metrics: dict[str, Any], policy_version: int, batch_size: int
    ) -> bool:
        """Record step ``step`` and advance the run, atomically; False if it was already recorded."""
        with self.tx() as db:
            row = db.execute("SELECT completed_steps FROM runs WHERE id=?", (run_id,)).fetchone()
            if row is None or int(row["completed_steps"]) != step:
                return False
            db.execute(
                "INSERT INTO run_steps (run_id, step, metrics) VALUES (?, ?, ?)",
                (run_id, step, json.dumps(metrics)),
            )
            db.execute(
                "UPDATE runs SET completed_steps=?, policy_version=?, batch_size=?, updated_at=? WHERE id=?",
                (step + 1, policy_version, batch_size, time.time(), run_id),
            )
            return True

    def add_run_samples(self, run_id: str, step: int, scored: Sequence[tuple[Any, Any]]) -> None:
        """Store a few scored groups of step ``step`` (``(Group, RewardResult)`` pairs) for the run
        page; a re-walked step (after a restart) replaces them."""
        with self.tx() as db:
            db.execute("DELETE FROM run_samples WHERE run_id=? AND step=?", (run_id, step))
            db.executemany(
                "INSERT INTO run_samples (run_id, step, idx, group_id, grp, rewards) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                [
                    (run_id, step, i, g.id, g.model_dump_json(), r.model_dump_json())
                    for i, (g, r) in enumerate(scored)
                ],
            )

    def run_samples(self, run_id: str, step: int | None = None, after: int = -1) -> list[dict[str, Any]]:
        """Stored groups of a run, by step then index: ``{step, idx, group_id, group, rewards}`` with
        ``group`` a loom.contracts.wire.Group and ``rewards`` a RewardResult, as JSON objects; one
        step's (``step``) or every step after ``after``."""
        where, args = ("step=?", (run_id, step)) if step is not None else ("step>?", (run_id, after))
        rows = (
            self._db()
            .execute(
                f"SELECT step, idx, group_id, grp, rewards FROM run_samples WHERE run_id=? AND {where} "
                "ORDER BY step, idx",
                args,
            )
            .fetchall()
        )
        return [
            {
                "step": int(r["step"]),
                "idx": int(r["idx"]),
                "group_id": r["group_id"],
                "group": json.loads(r["grp"]),
                "rewards": json.loads(r["rewards"]),
            }
            for r in rows
        ]

    def run_steps(self, run_id: str, after: int = -1) -> list[dict[str, Any]]:
        rows = (
            self._db()
            .execute("SELECT metrics FROM run_steps WHERE run_id=? AND step>? ORDER BY step", (run_id, after))
            .fetchall()
        )
        return [json.loads(r["metrics"]) for r in rows]

    # -------------------------------------------------------------------------------------- datasets
    def dataset_usage(self, owner: str) -> tuple[int, int]:
        """(bytes, datasets) ``owner`` stores."""
        row = (
            self._db()
            .execute("SELECT COALESCE(SUM(bytes), 0), COUNT(*) FROM datasets WHERE owner=?", (owner,))
            .fetchone()
        )
        return int(row[0]), int(row[1])

    def owns_dataset(self, owner: str, dataset_id: str) -> bool:
        return self._owns(self._db(), owner, dataset_id)

    def add_dataset(
        self,
        owner: str,
        dataset_id: str,
        n_bytes: int,
        n_items: int,
        quotas: Quotas | None,
        place: Callable[[], None],
    ) -> bool:
        """Make ``owner`` an owner of ``dataset_id`` (True when it was not yet): ``place()`` puts its
        files in place inside the transaction, after ``quotas`` (QuotaExceeded: nothing placed). A
        dataset the owner already stores is placed again (same content) and costs nothing more."""
        with self.tx() as db:
            if self._owns(db, owner, dataset_id):
                place()
                return False
            if quotas is not None:
                held = db.execute(
                    "SELECT COALESCE(SUM(bytes), 0), COUNT(*) FROM datasets WHERE owner=?", (owner,)
                ).fetchone()
                problem = dataset_over_quota(
                    n_bytes, quotas, bytes_held=int(held[0]), datasets_held=int(held[1])
                )
                if problem is not None:
                    raise problem
            place()
            db.execute(
                "INSERT INTO datasets (owner, id, bytes, n_items, created_at) VALUES (?, ?, ?, ?, ?)",
                (owner, dataset_id, n_bytes, n_items, time.time()),
            )
            return True

    def drop_dataset(self, owner: str, dataset_id: str, remove: Callable[[], None]) -> str | None:
        """Forget ``owner``'s ``dataset_id``; ``remove()`` (inside the transaction, so no upload of the
        same content interleaves) when no other key stores it. KeyError when ``owner`` does not store
        it; the id of a queued or running run of ``owner`` that reads it (nothing dropped), else None."""
        marks = ",".join("?" * len(ACTIVE))
        with self.tx() as db:
            if not self._owns(db, owner, dataset_id):
                raise KeyError(dataset_id)
            reader = db.execute(
                f"SELECT id FROM runs WHERE owner=? AND status IN ({marks}) "  # noqa: S608
                "AND json_extract(config, '$.dataset.id')=? LIMIT 1",
                (owner, *ACTIVE, dataset_id),
            ).fetchone()
            if reader is not None:
                return str(reader["id"])
            db.execute("DELETE FROM datasets WHERE owner=? AND id=?", (owner, dataset_id))
            if db.execute("SELECT 1 FROM datasets WHERE id=?", (dataset_id,)).fetchone() is None:
                remove()
            return None

    @staticmethod
    def _owns(db: sqlite3.Connection, owner: str, dataset_id: str) -> bool:
        row = db.execute("SELECT 1 FROM datasets WHERE owner=? AND id=?", (owner, dataset_id)).fetchone()
        return row is not None
