"""The policy store as a directory: versioned checkpoints (full safetensors or LoRA adapters).

The layout is loom/store/layout.py's. A version becomes visible only after its directory is complete
(written under a temporary name, then renamed), so a reader never loads a half-written checkpoint;
its files are read-only from then on, and its manifest (loom/store/manifest.py) is hashed at publish,
so what is served later is checked against what was published. Loom's learner publishes here with
``publish``; trainers' versions arrive through loom/store/uploads.py (docs/interop-rollout.md).
"""

from __future__ import annotations

import errno
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Literal

from loom.contracts.policies import LEARNER_NAMESPACE, PolicyMatch, PolicyRef, is_namespace
from loom.contracts.wire import PolicyVersion
from loom.store.errors import IntegrityError, PublishNotFound
from loom.store.layout import (
    LATEST,
    REGISTERED,
    namespace_parts,
    namespace_root,
    open_no_follow,
    read_latest,
    read_record,
    temporary,
    version_dir,
    versions_in,
    write_floor,
    write_latest,
)
from loom.store.manifest import file_hashes, hash_stream, read_files, write_records
from loom.store.reader import ReaderBase, resolve


class PolicyStore(ReaderBase):
    def __init__(self, root: str | Path, *, create: bool = True, namespace: str | None = None) -> None:
        """``create=False``: a reader that never makes the folder (the gateway: it writes nothing).
        ``namespace``: a trainer's versions (``<root>/ns/<name>``) instead of the learner's."""
        if namespace is not None and not is_namespace(namespace):
            raise ValueError(f"{namespace!r} is not a policy namespace name")
        self.base = Path(root)
        self.name = namespace
        self.root = namespace_root(self.base, namespace)
        if create:
            self.root.mkdir(parents=True, exist_ok=True)

    def namespace(self, name: str | None) -> PolicyStore:
        """The same store's versions of namespace ``name`` (None: the learner's)."""
        return PolicyStore(self.base, create=False, namespace=name)

    def path_of(self, version: int) -> Path:
        return version_dir(self.root, version)

    def versions(self) -> list[int]:
        return versions_in(self.root)

    def latest(self) -> PolicyVersion | None:
        marked = read_latest(self.root)
        if marked is not None and (found := self.get(marked)) is not None:
            return found
        vs = self.versions()
        return self.get(vs[-1]) if vs else None

    def get(self, version: int) -> PolicyVersion | None:
        return read_record(self.root, version)

    def loadable(
        self, namespace: str | None, version: int, match: PolicyMatch = "at_least"
    ) -> PolicyVersion | None:
        """``find``; a registered path, which stays its trainer's and is read here directly, is
        checked here first (``verify``: ``IntegrityError`` for a file changed since publish)."""
        view = self.namespace(namespace)
        found = resolve(view, version, match)
        if found is not None and found.meta.get(REGISTERED):
            view.verify(found.version)
        return found

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
        tmp = temporary(self.root, version)
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
            return self.seal(tmp, record, file_hashes(tmp))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def seal(self, tmp: Path, record: PolicyVersion, files: list[dict[str, Any]]) -> PolicyVersion:
        """Write ``tmp``'s records, make its files read-only and rename it to the version's folder
        (FileExistsError when that version exists); LATEST follows when it is the newest."""
        write_records(tmp, record, files)
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
            write_latest(self.root, record.version)
        return record

    def manifest(self, version: int) -> dict[str, Any] | None:
        """Version ``version``'s record and files (``{"policy": ..., "files": [{path, size, sha256}]}``)
        as written at publish; None when the version (or its manifest) is missing: a version without
        one is never served, since nothing would say which bytes are genuine."""
        record = self.get(version)
        files = None if record is None else read_files(self.path_of(version))
        if record is None or files is None:
            return None
        return {"policy": record.model_dump(mode="json"), "files": files}

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
            parts = [*namespace_parts(self.name), f"v{version}", *rel.split("/")]
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
                    got = hash_stream(src)
            except FileNotFoundError as exc:
                raise IntegrityError(f"policy version {version}: {f['path']} is gone or a link") from exc
            if got != (f["size"], f["sha256"]):
                raise IntegrityError(
                    f"policy version {version}: {f['path']} is not the file hashed at publish"
                )

    def delete(self, version: int) -> None:
        """Remove version ``version``: renamed away first (a reader sees it whole or not at all), its
        number kept as the floor (``write_floor``) and LATEST moved to the newest left."""
        final = self.path_of(version)
        gone = temporary(self.root, version, "deleted-" + uuid.uuid4().hex[:8])
        os.rename(final, gone)
        write_floor(self.root, version)
        shutil.rmtree(gone, ignore_errors=True)
        left = self.versions()
        if left:
            write_latest(self.root, left[-1])
        else:
            (self.root / LATEST).unlink(missing_ok=True)

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


def policy_ref(record: PolicyVersion, files: list[dict[str, Any]]) -> PolicyRef:
    """A version as a trainer sees it: no server path."""
    return PolicyRef(
        namespace=record.namespace or LEARNER_NAMESPACE,
        version=record.version,
        kind=record.kind,
        files=files,
        created_at=record.created_at,
        registered=bool(record.meta.get(REGISTERED)),
    )
