"""Trainers' versions arriving: uploads in parts, and registered paths (docs/interop-rollout.md).

An upload lives in ``<root>/.uploads/<id>/`` (on the store's filesystem, so the commit is a rename):
its files are declared first (path, size, sha256), each arrives in parts appended at their offset
(each request body stays under the services' body limit), and when a file's declared size is reached
its sha256 is checked and a mismatch drops it. The commit checks every declared file is there and
seals the version. A registered path is a checkpoint folder on a filesystem the replicas share,
hashed at registration. Publishers of one namespace take turns on a lock file, across the processes
of the store's host.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from loom.contracts.policies import (
    PolicyRef,
    RegisterRequest,
    UploadRequest,
    UploadTicket,
    file_path_problem,
    is_namespace,
)
from loom.contracts.wire import PolicyVersion
from loom.store.checks import Bounds, check_checkpoint
from loom.store.errors import (
    IntegrityError,
    PublishConflict,
    PublishError,
    PublishForbidden,
    PublishNotFound,
    QuotaExceeded,
)
from loom.store.layout import REGISTERED, UPLOADS, read_floor, temporary
from loom.store.local import PolicyStore, policy_ref
from loom.store.manifest import file_hashes, sha256_of

UPLOAD_ID = re.compile(r"[0-9a-f]{32}")
MAX_OPEN_UPLOADS = 4  # per namespace: the disk an abandoned upload can hold is bounded


class Part:
    """One request's bytes of an uploaded file, appended to what earlier requests sent."""

    def __init__(self, part: Path, done: Path, declared: dict[str, Any], offset: int) -> None:
        self.path, self.done, self.declared = part, done, declared
        self.out = open(part, "ab")  # noqa: SIM115 (closed by finish / abort)
        try:
            fcntl.flock(self.out, fcntl.LOCK_EX | fcntl.LOCK_NB)  # one writer per file
        except BlockingIOError:
            self.out.close()
            raise PublishConflict(f"{declared['path']} is being sent by another request") from None
        self.size = self.out.tell()
        if offset != self.size:
            self.out.close()
            raise PublishConflict(
                f"{declared['path']} holds {self.size} bytes: send the part at offset {self.size}"
            )

    def write(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.declared["size"]:
            self.abort()
            raise IntegrityError(
                f"{self.declared['path']}: more than the declared {self.declared['size']} bytes"
            )
        self.out.write(chunk)

    def finish(self) -> int:
        """Close the part; when the file is complete, check its sha256 and keep it. The bytes held."""
        self.out.close()
        if self.size == self.declared["size"]:
            got = sha256_of(self.path)
            if got != self.declared["sha256"]:
                self.path.unlink(missing_ok=True)
                raise IntegrityError(
                    f"{self.declared['path']}: sha256 {got} is not the declared {self.declared['sha256']}"
                )
            self.done.parent.mkdir(parents=True, exist_ok=True)
            os.rename(self.path, self.done)
        return self.size

    def abort(self) -> None:
        """Drop the whole file (a broken or refused part): it is sent again from offset 0."""
        self.out.close()
        self.path.unlink(missing_ok=True)


def _seal_new(
    ns: PolicyStore, tmp: Path, policy: PolicyVersion, files: list[dict[str, Any]], *used: Path
) -> None:
    """Seal ``tmp`` as version ``policy`` of ``ns``: a version already there is a ``PublishConflict``;
    ``tmp`` and the ``used`` folders are removed whatever happens."""
    try:
        ns.seal(tmp, policy, files)
    except FileExistsError as exc:
        raise PublishConflict(f"version {policy.version} exists") from exc
    finally:
        for folder in (tmp, *used):
            shutil.rmtree(folder, ignore_errors=True)


class Uploads:
    """Uploads and registrations into the namespaces of ``store``'s root (``<root>/.uploads/``),
    each version sealed by ``PolicyStore.seal``; at most ``max_bytes`` a version and ``quota_bytes``
    a namespace (its versions and open uploads together), an upload not committed within ``ttl_s``
    dropped. ``bounds``: what a version's config and weights may declare (loom/store/checks.py), or
    what makes them when first needed, checked before a version is sealed; None checks nothing.
    ``private``: folders a registered path may never be in or hold (the data dir)."""

    def __init__(
        self,
        store: PolicyStore,
        *,
        max_bytes: int,
        ttl_s: float,
        quota_bytes: int | None = None,
        bounds: Bounds | Callable[[], Bounds] | None = None,
        private: tuple[Path, ...] = (),
    ) -> None:
        self.store = store.namespace(None)
        self.max_bytes, self.ttl_s = max_bytes, ttl_s
        self.quota_bytes = quota_bytes
        self.bounds = bounds
        self.dir = self.store.base / UPLOADS
        self.private = tuple(Path(os.path.abspath(p)) for p in (self.store.base, *private))

    def declare(self, namespace: str, req: UploadRequest) -> UploadTicket:
        ns = self._ns(namespace)
        total = sum(f.size for f in req.files)
        if total > self.max_bytes:
            raise PublishError(
                f"the files hold {total} bytes; a version may hold {self.max_bytes} "
                "(LOOM_GATEWAY_POLICY_MAX_BYTES)"
            )
        self.dir.mkdir(parents=True, exist_ok=True)
        with self._locked(namespace):
            self._expire()
            open_here = [r for r in self._records() if r["namespace"] == namespace]
            if len(open_here) >= MAX_OPEN_UPLOADS:
                raise PublishConflict(
                    f"{len(open_here)} uploads of this namespace are open: commit or let one expire"
                )
            self._fits(ns, total, open_here)
            version = self._next_version(ns, req.version)
            upload_id = uuid.uuid4().hex
            folder = self.dir / upload_id
            (folder / "files").mkdir(parents=True)
            (folder / "parts").mkdir()
            record = {
                "namespace": namespace,
                "version": version,
                "kind": req.kind,
                "files": [f.model_dump() for f in req.files],
                "meta": req.meta,
                "created": time.time(),
            }
            (folder / "upload.json").write_text(json.dumps(record))
        return UploadTicket(upload_id=upload_id, namespace=namespace, version=version)

    def part(self, namespace: str, upload_id: str, path: str, offset: int) -> Part:
        """A writer appending to file ``path`` at ``offset`` (the bytes it holds so far): write its
        chunks, then ``finish``. A part past the declared size, or a complete file whose sha256 is
        not the declared one, is an ``IntegrityError`` and the file is dropped (sent again from 0)."""
        folder, record = self._upload(namespace, upload_id)
        declared = next((f for f in record["files"] if f["path"] == path), None)
        if declared is None:
            raise PublishNotFound(f"upload {upload_id} declared no file {path!r}")
        done = folder / "files" / path
        if done.exists():
            raise PublishConflict(f"{path} has already arrived intact")
        return Part(folder / "parts" / path.replace("/", "%"), done, declared, offset)

    def commit(self, namespace: str, upload_id: str) -> PolicyRef:
        folder, record = self._upload(namespace, upload_id)
        missing = [f["path"] for f in record["files"] if not (folder / "files" / f["path"]).is_file()]
        if missing:
            raise IntegrityError(f"not every declared file arrived intact: {', '.join(missing)} missing")
        ns = self._ns(namespace)
        try:
            self._check(folder / "files", [f["path"] for f in record["files"]], record["kind"])
        except PublishError:
            shutil.rmtree(folder, ignore_errors=True)  # it can never commit: its slot is freed
            raise
        with self._locked(namespace):
            try:
                self._above_latest(ns, record["version"])
            except PublishConflict:  # another upload took the number: this one can never commit
                shutil.rmtree(folder, ignore_errors=True)
                raise
            ns.root.mkdir(parents=True, exist_ok=True)
            tmp = temporary(ns.root, record["version"], upload_id)
            os.rename(folder / "files", tmp)
            policy = PolicyVersion(
                version=record["version"],
                path=str(ns.path_of(record["version"])),
                namespace=namespace,
                kind=record["kind"],
                created_at=time.time(),
                meta=record["meta"],
            )
            files = sorted(record["files"], key=lambda f: f["path"])
            _seal_new(ns, tmp, policy, files, folder)
        return policy_ref(policy, files)

    def register(self, namespace: str, req: RegisterRequest, roots: list[Path]) -> PolicyRef:
        """Version ``req.version`` of ``namespace`` at ``req.path``, hashed now; the path must be a
        folder under one of ``roots`` reached without a link, holding no link."""
        if not roots:
            raise PublishForbidden("registering paths is off here (LOOM_GATEWAY_POLICY_REGISTER_ROOTS)")
        given = Path(req.path)
        if not given.is_absolute() or os.path.normpath(given) != str(given):
            raise PublishError("path must be absolute and normalized")
        if not any(given.is_relative_to(r) and given != r for r in roots):
            raise PublishForbidden("path is not under a register root (LOOM_GATEWAY_POLICY_REGISTER_ROOTS)")
        if any(given.is_relative_to(p) or p.is_relative_to(given) for p in self.private):
            # the store's versions are its namespaces' own, and the data dir holds every key's state
            raise PublishForbidden("path is in, or holds, Loom's own data: register a folder of your own")
        if not given.is_dir() or given.resolve() != given:
            raise PublishError("path is not a folder reached without links")
        for p in given.rglob("*"):
            if p.is_symlink():
                raise PublishError(f"{p.relative_to(given)} is a link: a registered folder holds none")
        listed = [p.relative_to(given).as_posix() for p in sorted(given.rglob("*")) if p.is_file()]
        for rel in listed:  # the uploads' allow-list: checkpoint files only, nothing hidden
            problem = file_path_problem(rel)
            if problem is not None:
                raise PublishError(f"the folder holds a file a version may not: {problem}")
        if not listed:
            raise PublishError("the folder holds no file")
        self._check(given, listed, req.kind)
        files = file_hashes(given)
        ns = self._ns(namespace)
        with self._locked(namespace):
            self._fits(
                ns, sum(f["size"] for f in files), [r for r in self._records() if r["namespace"] == namespace]
            )
            version = self._next_version(ns, req.version)
            ns.root.mkdir(parents=True, exist_ok=True)
            tmp = temporary(ns.root, version, uuid.uuid4().hex)
            tmp.mkdir()
            policy = PolicyVersion(
                version=version,
                path=str(given),
                namespace=namespace,
                kind=req.kind,
                created_at=time.time(),
                meta={**req.meta, REGISTERED: True},
            )
            _seal_new(ns, tmp, policy, files)
        return policy_ref(policy, files)

    def _ns(self, namespace: str) -> PolicyStore:
        if not is_namespace(namespace):
            raise PublishForbidden(
                f"{namespace!r} cannot name a policy namespace (letters, digits, _.-; not 'loom'): "
                "publish with a key of another name"
            )
        return self.store.namespace(namespace)

    def abort(self, namespace: str, upload_id: str) -> None:
        """Drop an open upload and free its slot (another namespace's: not found, like a missing one)."""
        folder, _ = self._upload(namespace, upload_id)
        shutil.rmtree(folder, ignore_errors=True)

    def delete(self, namespace: str, version: int, pinned: set[int]) -> None:
        """Delete ``namespace``'s version ``version`` unless it is one of ``pinned`` (what its queued
        and running work names: 409). Its number is never taken again (the namespace's floor), so a
        replica's cached copy of it can never be mistaken for a later upload."""
        ns = self._ns(namespace)
        with self._locked(namespace):
            if ns.get(version) is None:
                raise PublishNotFound(f"no policy version {version}")
            if version in pinned:
                raise PublishConflict(f"version {version} is named by this key's queued or running work")
            ns.delete(version)

    def used_bytes(self, ns: PolicyStore, open_here: list[dict[str, Any]]) -> int:
        """What ``ns`` holds against its quota: its versions' files (registered ones too) and the
        declared files of its open uploads."""
        held = sum(f["size"] for ref in ns.refs() for f in ref.files)
        return held + sum(f["size"] for r in open_here for f in r["files"])

    def _fits(self, ns: PolicyStore, total: int, open_here: list[dict[str, Any]]) -> None:
        if self.quota_bytes is None:
            return
        used = self.used_bytes(ns, open_here)
        if used + total > self.quota_bytes:
            raise QuotaExceeded(
                f"the version's {total} bytes do not fit beside the {used} this key's versions and "
                f"uploads hold; a key may hold {self.quota_bytes} (LOOM_GATEWAY_POLICY_QUOTA_BYTES): "
                "delete a version (DELETE /v1/policies/{version}) or abort an upload",
                quota="policy_bytes",
                limit=self.quota_bytes,
                requested=total,
                in_use=used,
            )

    def _check(self, folder: Path, paths: list[str], kind: str) -> None:
        """``check_checkpoint`` under the bounds (read from the base model when first needed)."""
        if self.bounds is not None:
            bounds = self.bounds if isinstance(self.bounds, Bounds) else self.bounds()
            check_checkpoint(folder, paths, kind, bounds)

    def _next_version(self, ns: PolicyStore, asked: int | None) -> int:
        latest = ns.latest()
        newest = max(0 if latest is None else latest.version, read_floor(ns.root))
        if asked is None:
            return newest + 1
        self._above_latest(ns, asked)
        return asked

    @staticmethod
    def _above_latest(ns: PolicyStore, version: int) -> None:
        latest = ns.latest()
        newest = max(0 if latest is None else latest.version, read_floor(ns.root))
        if ns.get(version) is not None:
            raise PublishConflict(f"version {version} exists: a published version never changes")
        if version <= newest:
            raise PublishConflict(f"version {version} is not above the newest, {newest}")

    def _upload(self, namespace: str, upload_id: str) -> tuple[Path, dict[str, Any]]:
        """The upload's folder and record; another namespace's upload is not found, like a missing one."""
        folder = self.dir / upload_id
        meta = folder / "upload.json"
        if UPLOAD_ID.fullmatch(upload_id) is None or not meta.is_file():
            raise PublishNotFound(f"no upload {upload_id}")
        record: dict[str, Any] = json.loads(meta.read_text())
        if record["namespace"] != namespace:
            raise PublishNotFound(f"no upload {upload_id}")
        if time.time() - record["created"] > self.ttl_s:
            shutil.rmtree(folder, ignore_errors=True)
            raise PublishNotFound(f"no upload {upload_id} (it expired)")
        return folder, record

    def _records(self) -> list[dict[str, Any]]:
        out = []
        for meta in self.dir.glob("*/upload.json"):
            try:
                out.append({**json.loads(meta.read_text()), "folder": meta.parent})
            except (OSError, ValueError):
                continue
        return out

    def _expire(self) -> None:
        now = time.time()
        for r in self._records():
            if now - r["created"] > self.ttl_s:
                shutil.rmtree(r["folder"], ignore_errors=True)

    @contextmanager
    def _locked(self, namespace: str) -> Iterator[None]:
        """One publisher of a namespace at a time (across the processes of this host)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir / f".lock-{namespace}", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)
