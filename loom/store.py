"""Policy store: versioned policy checkpoints (full safetensors or LoRA adapters) on a shared path.

Layout: ``<root>/v<version>/`` holds the checkpoint, ``<root>/v<version>/policy.json`` its
PolicyVersion record and ``<root>/v<version>/manifest.json`` each file's size and sha256 (written at
publish, so what is served later is checked against what was published); ``<root>/LATEST`` names the
newest complete version. A version becomes visible only after its directory is complete (written
under a temporary name, then renamed), so a reader never loads a half-written checkpoint; its files
are read-only from then on.

Namespaces: Loom's learner publishes into the root; an external trainer's versions live in
``<root>/ns/<name>/`` with the same layout (``PolicyStore.namespace``). They arrive as uploads
(``Uploads``: declared files, streamed parts checked against their sha256, an atomic commit) or as
registered paths on a filesystem the replicas share (docs/interop-rollout.md).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Literal, Protocol

from loom.contracts.policies import (
    LEARNER_NAMESPACE,
    PolicyRef,
    RegisterRequest,
    UploadRequest,
    UploadTicket,
    is_namespace,
)
from loom.contracts.wire import PolicyVersion


class PolicyStore:
    def __init__(self, root: str | Path, *, create: bool = True, namespace: str | None = None) -> None:
        """``create=False``: a reader that never makes the folder (the gateway's submission check).
        ``namespace``: a trainer's versions (``<root>/ns/<name>``) instead of the learner's."""
        if namespace is not None and not is_namespace(namespace):
            raise ValueError(f"{namespace!r} is not a policy namespace name")
        self.base = Path(root)
        self.name = namespace
        self.root = self.base if namespace is None else self.base / NAMESPACES / namespace
        if create:
            self.root.mkdir(parents=True, exist_ok=True)

    def namespace(self, name: str | None) -> PolicyStore:
        """The same store's versions of namespace ``name`` (None: the learner's)."""
        return PolicyStore(self.base, create=False, namespace=name)

    def path_of(self, version: int) -> Path:
        return self.root / f"v{version}"

    def versions(self) -> list[int]:
        out = []
        for p in self.root.glob("v*"):
            if p.is_dir() and p.name[1:].isdigit() and (p / "policy.json").exists():
                out.append(int(p.name[1:]))
        return sorted(out)

    def latest(self) -> PolicyVersion | None:
        marker = self.root / "LATEST"
        if marker.exists():
            v = int(marker.read_text().strip())
            return self.get(v)
        vs = self.versions()
        return self.get(vs[-1]) if vs else None

    def serving(self, version: int) -> PolicyVersion | None:
        """What a replica asked for ``version`` loads: that version, or the newest one above it when
        it is gone (pruned); None when the store holds neither (rollout's catch-up, the gateway's
        submission check)."""
        return serving_of(self, version)

    def get(self, version: int) -> PolicyVersion | None:
        meta = self.path_of(version) / "policy.json"
        if not meta.exists():
            return None
        return PolicyVersion.model_validate_json(meta.read_text())

    def publish(
        self,
        version: int,
        write: Callable[[Path], None],
        *,
        kind: Literal["full", "lora"] = "full",
        meta: dict[str, Any] | None = None,
    ) -> PolicyVersion:
        """Write version ``version`` with ``write(tmp_dir)`` and make it visible atomically, its
        manifest hashed now (what a replica pulls later is checked against these bytes)."""
        final = self.path_of(version)
        if final.exists():
            raise FileExistsError(f"policy version {version} already exists at {final}")
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-v{version}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        try:
            write(tmp)
            record = PolicyVersion(
                version=version,
                path=str(final),
                namespace=self.name,
                kind=kind,
                created_at=time.time(),
                meta=meta or {},
            )
            return self._seal(tmp, record, file_hashes(tmp))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _seal(self, tmp: Path, record: PolicyVersion, files: list[dict[str, Any]]) -> PolicyVersion:
        """Write ``tmp``'s records, make its files read-only and rename it to the version's folder
        (FileExistsError when that version exists); LATEST follows when it is the newest."""
        (tmp / "policy.json").write_text(record.model_dump_json(indent=2))
        (tmp / MANIFEST).write_text(json.dumps(files, indent=1))
        for p in tmp.rglob("*"):
            if p.is_file() and not p.is_symlink():
                p.chmod(0o444)
        final = self.path_of(record.version)
        try:
            os.rename(tmp, final)  # fails when final exists and is not empty: a version never changes
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise FileExistsError(f"policy version {record.version} already exists") from exc
            raise
        current = self.latest()
        if current is None or current.version <= record.version:
            latest_tmp = self.root / f".LATEST-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            latest_tmp.write_text(str(record.version))
            os.replace(latest_tmp, self.root / "LATEST")
        return record

    def manifest(self, version: int) -> dict[str, Any] | None:
        """Version ``version``'s record and files (``{"policy": ..., "files": [{path, size, sha256}]}``)
        as written at publish; None when the version (or its manifest) is missing: a version without
        one is never served, since nothing would say which bytes are genuine."""
        record = self.get(version)
        stored = self.path_of(version) / MANIFEST
        if record is None or not stored.is_file():
            return None
        return {"policy": record.model_dump(mode="json"), "files": json.loads(stored.read_text())}

    def source_of(self, record: PolicyVersion) -> Path:
        """Where ``record``'s files are: its folder in the store, or the path it was registered at."""
        return Path(record.path) if record.meta.get(REGISTERED) else self.path_of(record.version)

    @contextmanager
    def open_file(self, version: int, rel: str) -> Iterator[IO[bytes]]:
        """Version ``version``'s file ``rel`` (a path its manifest lists), opened without following
        a link at any component below the store's root (for a registered path, at any component at
        all, as at its registration): a file swapped for a symlink, or put behind a symlinked folder,
        after publish is refused (``FileNotFoundError``), and so is anything but a regular file."""
        record = self.get(version)
        if record is None:
            raise FileNotFoundError(rel)
        if record.meta.get(REGISTERED):
            top, parts = Path("/"), [*Path(record.path).parts[1:], *rel.split("/")]
        else:
            top = self.base
            inside = [] if self.name is None else [NAMESPACES, self.name]
            parts = [*inside, f"v{version}", *rel.split("/")]
        f = open_no_follow(top, parts)
        try:
            yield f
        finally:
            f.close()

    def verify(self, version: int) -> None:
        """Check every file of ``version`` against its manifest (size and sha256, each opened as
        ``open_file`` does); ``IntegrityError`` naming the first that differs. For a registered path,
        which stays its trainer's, a replica that reads it directly calls this before loading."""
        found = self.manifest(version)
        if found is None:
            raise PublishNotFound(f"no policy version {version} (or no manifest)")
        for f in found["files"]:
            try:
                with self.open_file(version, f["path"]) as src:
                    h, size = hashlib.sha256(), 0
                    while chunk := src.read(1 << 20):
                        h.update(chunk)
                        size += len(chunk)
            except FileNotFoundError as exc:
                raise IntegrityError(f"policy version {version}: {f['path']} is gone or a link") from exc
            if (size, h.hexdigest()) != (f["size"], f["sha256"]):
                raise IntegrityError(
                    f"policy version {version}: {f['path']} is not the file hashed at publish"
                )

    def prune(self, keep: int = 3) -> list[int]:
        """Delete all but the newest ``keep`` versions; returns the deleted ones."""
        vs = self.versions()
        gone = vs[:-keep] if keep > 0 else vs
        for v in gone:
            shutil.rmtree(self.path_of(v), ignore_errors=True)
        return gone

    def refs(self) -> list[PolicyRef]:
        """The namespace's versions as trainers see them, oldest first."""
        out = []
        for v in self.versions():
            found = self.manifest(v)
            if found is not None:
                out.append(policy_ref(PolicyVersion.model_validate(found["policy"]), found["files"]))
        return out


MANIFEST = "manifest.json"
NAMESPACES = "ns"
REGISTERED = "registered"  # meta key: the version's files are at its path, on a shared filesystem


def policy_ref(record: PolicyVersion, files: list[dict[str, Any]]) -> PolicyRef:
    return PolicyRef(
        namespace=record.namespace or LEARNER_NAMESPACE,
        version=record.version,
        kind=record.kind,
        files=files,
        created_at=record.created_at,
        registered=bool(record.meta.get(REGISTERED)),
    )


def open_no_follow(top: Path, parts: list[str]) -> IO[bytes]:
    """``top/parts...`` opened for reading one component at a time with ``O_NOFOLLOW``: a link at any
    component, or a last component that is not a regular file, is ``FileNotFoundError``."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    dir_fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            try:
                nxt = os.open(part, flags | os.O_DIRECTORY, dir_fd=dir_fd)
            except OSError as exc:  # ELOOP / ENOTDIR: a link or a file where a folder should be
                raise FileNotFoundError(f"{part} is not a folder") from exc
            os.close(dir_fd)
            dir_fd = nxt
        try:
            fd = os.open(parts[-1], flags | os.O_NONBLOCK, dir_fd=dir_fd)
        except OSError as exc:
            raise FileNotFoundError(f"{parts[-1]} is not a regular file") from exc
    finally:
        os.close(dir_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise FileNotFoundError(f"{parts[-1]} is not a regular file")
    return os.fdopen(fd, "rb")


class _Reader(Protocol):
    def get(self, version: int) -> PolicyVersion | None: ...

    def latest(self) -> PolicyVersion | None: ...


def serving_of(store: _Reader, version: int) -> PolicyVersion | None:
    """``version`` or, when it is gone (pruned), the newest version above it; else None."""
    found = store.get(version)
    if found is None:
        latest = store.latest()
        found = latest if latest is not None and latest.version >= version else None
    return found


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def file_hashes(folder: Path) -> list[dict[str, Any]]:
    """Every regular file under ``folder`` but the store's records (and hidden temporaries), with its
    path relative to ``folder``, size and sha256, sorted by path."""
    out = []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if (
            not p.is_file()
            or p.is_symlink()
            or rel in (MANIFEST, "policy.json")
            or any(x.startswith(".") for x in rel.split("/"))
        ):
            continue
        out.append({"path": rel, "size": p.stat().st_size, "sha256": sha256_of(p)})
    return out


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


# --------------------------------------------------------------------------------------------------
# publishing by external trainers: uploads and registered paths


class PublishError(Exception):
    """A refused publication; ``status``/``error`` are the HTTP answer's (the gateway's and the
    learner's routes turn it into ``{"error", "detail"}``)."""

    status = 422
    error = "validation_error"

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail

    def body(self) -> dict[str, str]:
        return {"error": self.error, "detail": self.detail}


class PublishConflict(PublishError):
    status, error = 409, "conflict"


class PublishNotFound(PublishError):
    status, error = 404, "not_found"


class IntegrityError(PublishError):
    status, error = 422, "integrity_error"


class PublishForbidden(PublishError):
    status, error = 403, "forbidden"


UPLOADS = ".uploads"
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
        ns._seal(tmp, policy, files)
    except FileExistsError as exc:
        raise PublishConflict(f"version {policy.version} exists") from exc
    finally:
        for folder in (tmp, *used):
            shutil.rmtree(folder, ignore_errors=True)


class Uploads:
    """Uploads into a store's namespaces (``<root>/.uploads/<id>/``, on the store's filesystem so the
    commit is a rename). A file arrives in parts appended at their offset (each request body stays
    under the services' body limit); when its declared size is reached its sha256 is checked, and a
    mismatch drops it. The commit checks every declared file is there and seals the version."""

    def __init__(self, store: PolicyStore, *, max_bytes: int, ttl_s: float) -> None:
        self.store = store.namespace(None)
        self.max_bytes, self.ttl_s = max_bytes, ttl_s
        self.dir = self.store.base / UPLOADS

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
        with self._locked(namespace):
            self._above_latest(ns, record["version"])
            ns.root.mkdir(parents=True, exist_ok=True)
            tmp = ns.root / f".tmp-v{record['version']}-{upload_id}"
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
        if not given.is_dir() or given.resolve() != given:
            raise PublishError("path is not a folder reached without links")
        for p in given.rglob("*"):
            if p.is_symlink():
                raise PublishError(f"{p.relative_to(given)} is a link: a registered folder holds none")
        files = file_hashes(given)
        if not files:
            raise PublishError("the folder holds no file")
        ns = self._ns(namespace)
        with self._locked(namespace):
            version = self._next_version(ns, req.version)
            ns.root.mkdir(parents=True, exist_ok=True)
            tmp = ns.root / f".tmp-v{version}-{uuid.uuid4().hex}"
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

    # ----------------------------------------------------------------------------------------------

    def _ns(self, namespace: str) -> PolicyStore:
        if not is_namespace(namespace):
            raise PublishForbidden(
                f"{namespace!r} cannot name a policy namespace (letters, digits, _.-; not 'loom'): "
                "publish with a key of another name"
            )
        return self.store.namespace(namespace)

    def _next_version(self, ns: PolicyStore, asked: int | None) -> int:
        latest = ns.latest()
        newest = 0 if latest is None else latest.version
        if asked is None:
            return newest + 1
        self._above_latest(ns, asked)
        return asked

    @staticmethod
    def _above_latest(ns: PolicyStore, version: int) -> None:
        latest = ns.latest()
        if ns.get(version) is not None:
            raise PublishConflict(f"version {version} exists: a published version never changes")
        if latest is not None and version <= latest.version:
            raise PublishConflict(f"version {version} is not above the newest, {latest.version}")

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
