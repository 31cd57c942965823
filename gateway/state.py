"""Durable gateway state in SQLite (``<data_dir>/gateway.sqlite``): jobs, their scored groups, runs,
their step plans and completed steps. Every state change is one transaction (``Database.tx``), so a
killed gateway leaves either the old or the new state, never half of a step.

The shape is the FastAPI template's models + crud: typed rows (``JobRow``, ``RunRow``) and one small
store per kind of thing (``JobStore``, ``RunStore``, ``DatasetStore``) over one transaction helper;
``GatewayState`` holds them. Jobs and runs share what submitted work has in common (``WorkStore``:
idempotent creation under quotas, start, finish); an idempotency key that names different work raises
``Conflict``.

Uploaded datasets are owned: a ``datasets`` row per (key, dataset) says which keys stored which
content (the files themselves are shared, by content hash: gateway/datasets.py).

Each job and run records its cost (``samples``, ``tokens``: gateway/quotas.py); a submission is checked
against its key's quotas in the same transaction that inserts it, so concurrent submissions cannot
both slip under a limit.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

from gateway.models import JobRequest, JobStatus, RunRequest, RunStatus
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


class Conflict(Exception):
    """An idempotency key that names existing work (``item_id``) with a different request (a 409)."""

    def __init__(self, item_id: str) -> None:
        super().__init__(item_id)
        self.item_id = item_id


# ---------------------------------------------------------------------------------------------- rows
@dataclass(frozen=True)
class JobRow:
    id: str
    owner: str
    job_key: str
    status: JobStatus
    request: dict[str, Any]  # the submitted JobRequest, as JSON
    n_prompts: int
    error: str | None
    counters: dict[str, float]
    samples: int
    tokens: int
    created_at: float
    updated_at: float


@dataclass(frozen=True)
class RunRow:
    id: str
    owner: str
    run_key: str | None
    status: RunStatus
    config: dict[str, Any]  # the submitted RunRequest, as JSON
    completed_steps: int
    total_steps: int
    policy_version: int
    batch_size: int  # the next step's
    error: str | None
    samples: int
    tokens: int
    created_at: float
    updated_at: float


Row = TypeVar("Row", JobRow, RunRow)


def read_row(row_type: type[Row], r: sqlite3.Row, json_column: str) -> Row:
    """A ``row_type`` from its table's row; ``json_column`` (and ``counters``) hold JSON."""
    values = {f.name: r[f.name] for f in fields(row_type)}
    for column in (json_column, "counters"):
        if column in values:
            values[column] = json.loads(values[column] or "{}")
    return row_type(**values)


# ---------------------------------------------------------------------------------------- database
class Database:
    """One SQLite file: a connection per thread, and ``tx`` for a write transaction."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        # readers of this process woken by its commits (the event streams, ``watch``)
        self._watchers: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self._watch_lock = threading.Lock()
        db = self.connection()
        db.executescript(SCHEMA)
        for table in ("jobs", "runs", "job_groups"):
            have = {r["name"] for r in db.execute(f"PRAGMA table_info({table})")}
            for column in COST_COLUMNS:
                if column.split()[0] not in have:
                    db.execute(f"ALTER TABLE {table} ADD COLUMN {column}")

    def connection(self) -> sqlite3.Connection:
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
        db = self.connection()
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
        self._committed()

    def watch(self, event: asyncio.Event) -> None:
        """Set ``event`` (on the running loop) after every write transaction of this process commits,
        until ``unwatch``: an event stream wakes at a group's or a job's end's commit instead of at
        its next check of the change counter (which still catches other processes' commits)."""
        with self._watch_lock:
            self._watchers.add((asyncio.get_running_loop(), event))

    def unwatch(self, event: asyncio.Event) -> None:
        with self._watch_lock:
            self._watchers = {w for w in self._watchers if w[1] is not event}

    def _committed(self) -> None:
        with self._watch_lock:
            watchers = list(self._watchers)
        for loop, event in watchers:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # that loop is closed: its stream is gone
                self.unwatch(event)

    def all(self, sql: str, args: Sequence[Any] = ()) -> list[sqlite3.Row]:
        return self.connection().execute(sql, args).fetchall()

    def one(self, sql: str, args: Sequence[Any] = ()) -> sqlite3.Row | None:
        row: sqlite3.Row | None = self.connection().execute(sql, args).fetchone()
        return row


def _check_quota(db: sqlite3.Connection, owner: str, kind: str, cost: Cost, quotas: Quotas) -> None:
    """Raise QuotaExceeded when ``cost`` does not fit beside ``owner``'s queued and running work (jobs
    and runs together)."""
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


# ----------------------------------------------------------------------------------- jobs and runs


class WorkStore(Generic[Row]):
    """What jobs and runs share: a row type, idempotent creation under the key's quotas, start, finish."""

    kind: ClassVar[str]  # "job" or "run": the quota's kind, the ``<kind>_key`` column, the id's prefix
    table: ClassVar[str]
    body_column: ClassVar[str]  # the submitted request, as sorted JSON (what idempotency compares)
    startable: ClassVar[str]  # the statuses ``start`` may move to ``running``
    row_type: type[Row]

    def __init__(self, db: Database) -> None:
        self.db = db

    def get(self, item_id: str) -> Row | None:
        row = self.db.one(f"SELECT * FROM {self.table} WHERE id=?", (item_id,))  # noqa: S608
        return None if row is None else read_row(self.row_type, row, self.body_column)

    def status(self, item_id: str) -> str | None:
        row = self.db.one(f"SELECT status FROM {self.table} WHERE id=?", (item_id,))  # noqa: S608
        return None if row is None else str(row["status"])

    def with_status(self, *statuses: str) -> list[str]:
        """Ids, oldest first."""
        marks = ",".join("?" * len(statuses))
        sql = f"SELECT id FROM {self.table} WHERE status IN ({marks}) ORDER BY created_at"  # noqa: S608
        return [str(r["id"]) for r in self.db.all(sql, statuses)]

    def update(self, item_id: str, **fields: Any) -> None:
        """Write ``fields`` (columns) as they are; tests use it to put a row in a given state."""
        self._update(item_id, fields, "")

    def start(self, item_id: str) -> bool:
        """Mark it running unless it ended meanwhile (a cancel), atomically; False if it did."""
        return self._update(item_id, {"status": "running", "error": None}, f" AND {self.startable}")

    def finish(self, item_id: str, status: str, **fields: Any) -> bool:
        """Set a final ``status`` of work that is still queued or running: a cancel that came first is
        never overwritten by the end of the work it interrupted."""
        return self._update(item_id, {"status": status, **fields}, " AND status IN ('queued', 'running')")

    def cancelled_among(self, ids: Sequence[str]) -> set[str]:
        out: set[str] = set()
        for i in range(0, len(ids), 500):
            part = ids[i : i + 500]
            marks = ",".join("?" * len(part))
            sql = f"SELECT id FROM {self.table} WHERE status='cancelled' AND id IN ({marks})"  # noqa: S608
            out.update(str(r["id"]) for r in self.db.all(sql, part))
        return out

    def _update(
        self,
        item_id: str,
        fields: dict[str, Any],
        where: str,
        then: tuple[str, Sequence[Any]] | None = None,
    ) -> bool:
        """Write ``fields`` where ``where`` holds; ``then``: a statement run in the same transaction
        when the row was written."""
        fields = {**fields, "updated_at": time.time()}
        if isinstance(fields.get("counters"), dict):
            fields["counters"] = json.dumps(fields["counters"])
        cols = ", ".join(f"{k}=?" for k in fields)
        with self.db.tx() as db:
            cur = db.execute(
                f"UPDATE {self.table} SET {cols} WHERE id=?{where}",  # noqa: S608
                (*fields.values(), item_id),
            )
            if cur.rowcount > 0 and then is not None:
                db.execute(*then)
            return cur.rowcount > 0

    def create(
        self, *, owner: str, request: Any, cost: Cost = Cost(0, 0), quotas: Quotas | None = None
    ) -> tuple[str, bool]:
        """(id, created) for ``owner``'s ``request`` (a JobRequest or RunRequest): an existing one under
        its idempotency key returns its id and False (``Conflict`` when its request differs); a new one
        over one of ``quotas`` (beside the owner's queued and running work) raises QuotaExceeded; else
        it is stored, queued, with its ``cost``."""
        key, columns = self.columns(request)
        body = json.dumps(request.model_dump(mode="json"), sort_keys=True)
        with self.db.tx() as db:
            if key is not None:
                row = db.execute(
                    f"SELECT id, {self.body_column} FROM {self.table} WHERE owner=? AND {self.kind}_key=?",  # noqa: S608
                    (owner, key),
                ).fetchone()
                if row is not None:
                    if row[self.body_column] != body:
                        raise Conflict(str(row["id"]))
                    return str(row["id"]), False
            if quotas is not None:
                _check_quota(db, owner, self.kind, cost, quotas)
            item_id = f"{self.kind}-" + uuid.uuid4().hex[:16]
            now = time.time()
            values = {
                "id": item_id,
                "owner": owner,
                f"{self.kind}_key": key,
                "status": "queued",
                self.body_column: body,
                **columns,
                "samples": cost.samples,
                "tokens": cost.tokens,
                "created_at": now,
                "updated_at": now,
            }
            db.execute(
                f"INSERT INTO {self.table} ({', '.join(values)}) VALUES ({', '.join('?' * len(values))})",  # noqa: S608
                tuple(values.values()),
            )
            return item_id, True

    def columns(self, request: Any) -> tuple[str | None, dict[str, Any]]:
        """``request``'s idempotency key and the columns a new row of it starts with."""
        raise NotImplementedError


class JobStore(WorkStore[JobRow]):
    kind, table, body_column = "job", "jobs", "request"
    startable = "status IN ('queued', 'running')"
    row_type = JobRow

    def columns(self, request: JobRequest) -> tuple[str | None, dict[str, Any]]:
        return request.job_key, {"n_prompts": len(request.items())}

    def add_group(self, job_id: str, idx: int, payload: dict[str, Any]) -> None:
        self.add_groups(job_id, [(idx, payload)])

    def add_groups(
        self,
        job_id: str,
        groups: Sequence[tuple[int, dict[str, Any]]],
        produced: Sequence[Cost] | None = None,
    ) -> None:
        """Store groups of ``job_id`` (index, payload) in one transaction (one commit for groups that
        finished together), with what each ``produced`` (gateway/cost.py; every round and revision it
        generated): each gets the next sequence number, an index already stored is kept (with what
        it produced: a redelivered or resumed group is never counted twice)."""
        costs = list(produced) if produced is not None else [Cost(0, 0)] * len(groups)
        with self.db.tx() as db:
            for (idx, payload), cost in zip(groups, costs, strict=True):
                seq = db.execute("SELECT COUNT(*) FROM job_groups WHERE job_id=?", (job_id,)).fetchone()[0]
                db.execute(
                    "INSERT OR IGNORE INTO job_groups (job_id, idx, seq, payload, samples, tokens) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    (job_id, idx, seq, json.dumps(payload), cost.samples, cost.tokens),
                )

    def finish(self, item_id: str, status: str, **fields: Any) -> bool:
        """``WorkStore.finish``, and the job's charge settled in the same transaction: its ``samples``
        and ``tokens`` become what its stored groups produced (the rest of its admission charge,
        its mode's worst case, is given back: docs/security.md "Quotas")."""
        settle = (
            "UPDATE jobs SET samples=(SELECT COALESCE(SUM(samples), 0) FROM job_groups WHERE job_id=?), "
            "tokens=(SELECT COALESCE(SUM(tokens), 0) FROM job_groups WHERE job_id=?) WHERE id=?"
        )
        return self._update(
            item_id,
            {"status": status, **fields},
            " AND status IN ('queued', 'running')",
            then=(settle, (item_id, item_id, item_id)),
        )

    def produced(self, job_id: str) -> Cost:
        """What the groups ``job_id`` has stored produced (its settled charge once it has ended)."""
        row = self.db.one(
            "SELECT COALESCE(SUM(samples), 0), COALESCE(SUM(tokens), 0) FROM job_groups WHERE job_id=?",
            (job_id,),
        )
        return Cost(0, 0) if row is None else Cost(int(row[0]), int(row[1]))

    def groups(self, job_id: str, after_seq: int = -1) -> list[tuple[int, dict[str, Any]]]:
        """(sequence number, ScoredGroup as JSON) of the groups stored after ``after_seq``."""
        rows = self.db.all(
            "SELECT seq, payload FROM job_groups WHERE job_id=? AND seq>? ORDER BY seq", (job_id, after_seq)
        )
        return [(int(r["seq"]), json.loads(r["payload"])) for r in rows]

    def page(self, job_id: str, offset: int, limit: int) -> tuple[int, list[dict[str, Any]]]:
        """How many groups ``job_id`` has stored, and the payloads of ``limit`` of them from the
        ``offset``-th in prompt order (a large job's view is read a page at a time)."""
        row = self.db.one("SELECT COUNT(*) FROM job_groups WHERE job_id=?", (job_id,))
        rows = self.db.all(
            "SELECT payload FROM job_groups WHERE job_id=? ORDER BY idx LIMIT ? OFFSET ?",
            (job_id, limit, offset),
        )
        return (0 if row is None else int(row[0])), [json.loads(r["payload"]) for r in rows]

    def done_indices(self, job_id: str) -> set[int]:
        return {int(r["idx"]) for r in self.db.all("SELECT idx FROM job_groups WHERE job_id=?", (job_id,))}


class RunStore(WorkStore[RunRow]):
    kind, table, body_column = "run", "runs", "config"
    # a run that failed may be started again (its error cleared); a cancelled one never
    startable = "status != 'cancelled'"
    row_type = RunRow

    def columns(self, request: RunRequest) -> tuple[str | None, dict[str, Any]]:
        """Without a ``run_key``, every submission is a new run."""
        columns = {
            "total_steps": request.schedule.steps,
            "policy_version": request.initial_policy_version,
            "batch_size": request.schedule.batch_size,
        }
        return request.run_key, columns

    def plan(self, run_id: str, step: int, batch_size: int, gen_version: int) -> tuple[int, int]:
        """The (batch size, generation policy version) of ``step``: the first plan recorded wins, so a
        resumed gateway regenerates exactly the same prompts with the same task keys."""
        with self.db.tx() as db:
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
        with self.db.tx() as db:
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

    def add_samples(self, run_id: str, step: int, scored: Sequence[tuple[Any, Any]]) -> None:
        """Store a few scored groups of step ``step`` (``(Group, RewardResult)`` pairs) for the run
        page; a re-walked step (after a restart) replaces them."""
        with self.db.tx() as db:
            db.execute("DELETE FROM run_samples WHERE run_id=? AND step=?", (run_id, step))
            db.executemany(
                "INSERT INTO run_samples (run_id, step, idx, group_id, grp, rewards) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                [
                    (run_id, step, i, g.id, g.model_dump_json(), r.model_dump_json())
                    for i, (g, r) in enumerate(scored)
                ],
            )

    def samples(self, run_id: str, step: int | None = None, after: int = -1) -> list[dict[str, Any]]:
        """Stored groups of a run, by step then index: ``{step, idx, group_id, group, rewards}`` with
        ``group`` a loom.contracts.wire.Group and ``rewards`` a RewardResult, as JSON objects; one
        step's (``step``) or every step after ``after``."""
        where, args = ("step=?", (run_id, step)) if step is not None else ("step>?", (run_id, after))
        rows = self.db.all(
            f"SELECT step, idx, group_id, grp, rewards FROM run_samples WHERE run_id=? AND {where} "  # noqa: S608
            "ORDER BY step, idx",
            args,
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

    def steps(self, run_id: str, after: int = -1) -> list[dict[str, Any]]:
        """The metrics of the steps after ``after``, in order."""
        rows = self.db.all(
            "SELECT metrics FROM run_steps WHERE run_id=? AND step>? ORDER BY step", (run_id, after)
        )
        return [json.loads(r["metrics"]) for r in rows]


# -------------------------------------------------------------------------------------- datasets
class DatasetStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    def usage(self, owner: str) -> tuple[int, int]:
        """(bytes, datasets) ``owner`` stores."""
        return self._usage(self.db.connection(), owner)

    def owns(self, owner: str, dataset_id: str) -> bool:
        return self._owns(self.db.connection(), owner, dataset_id)

    def add(
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
        with self.db.tx() as db:
            if self._owns(db, owner, dataset_id):
                place()
                return False
            if quotas is not None:
                bytes_held, datasets_held = self._usage(db, owner)
                problem = dataset_over_quota(
                    n_bytes, quotas, bytes_held=bytes_held, datasets_held=datasets_held
                )
                if problem is not None:
                    raise problem
            place()
            db.execute(
                "INSERT INTO datasets (owner, id, bytes, n_items, created_at) VALUES (?, ?, ?, ?, ?)",
                (owner, dataset_id, n_bytes, n_items, time.time()),
            )
            return True

    def drop(self, owner: str, dataset_id: str, remove: Callable[[], None]) -> str | None:
        """Forget ``owner``'s ``dataset_id``; ``remove()`` (inside the transaction, so no upload of the
        same content interleaves) when no other key stores it. KeyError when ``owner`` does not store
        it; the id of a queued or running run of ``owner`` that reads it (nothing dropped), else None."""
        marks = ",".join("?" * len(ACTIVE))
        with self.db.tx() as db:
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
    def _usage(db: sqlite3.Connection, owner: str) -> tuple[int, int]:
        row = db.execute(
            "SELECT COALESCE(SUM(bytes), 0), COUNT(*) FROM datasets WHERE owner=?", (owner,)
        ).fetchone()
        return int(row[0]), int(row[1])

    @staticmethod
    def _owns(db: sqlite3.Connection, owner: str, dataset_id: str) -> bool:
        row = db.execute("SELECT 1 FROM datasets WHERE owner=? AND id=?", (owner, dataset_id)).fetchone()
        return row is not None


# ------------------------------------------------------------------------------------------ state
class GatewayState:
    """The gateway's database and its stores: ``jobs``, ``runs``, ``datasets``."""

    def __init__(self, path: str | Path) -> None:
        self.db = Database(path)
        self.path = self.db.path
        self.jobs = JobStore(self.db)
        self.runs = RunStore(self.db)
        self.datasets = DatasetStore(self.db)

    def data_version(self) -> int:
        """Changes when another connection commits (a cheap "anything new?" for event streams)."""
        row = self.db.one("PRAGMA data_version")
        assert row is not None
        return int(row[0])

    def cancelled_among(self, ids: Sequence[str]) -> set[str]:
        """The jobs and runs among ``ids`` whose status is ``cancelled``."""
        return self.jobs.cancelled_among(ids) | self.runs.cancelled_among(ids)

    def owner_of(self, item_id: str) -> str | None:
        """The key that submitted job or run ``item_id`` (None: neither is stored)."""
        row = self.db.one(
            "SELECT owner FROM jobs WHERE id=? UNION ALL SELECT owner FROM runs WHERE id=? LIMIT 1",
            (item_id, item_id),
        )
        return None if row is None else str(row["owner"])
