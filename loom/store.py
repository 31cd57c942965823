"""Policy store: versioned policy checkpoints (full safetensors or LoRA adapters) on a shared path.

Layout: ``<root>/v<version>/`` holds the checkpoint, ``<root>/v<version>/policy.json`` its
PolicyVersion record and ``<root>/v<version>/manifest.json`` (written when the version is first
served over HTTP, ``loom.remote_store``) each file's size and sha256; ``<root>/LATEST`` names the
newest complete version. A version becomes visible only after its directory is complete (written
under a temporary name, then renamed), so a reader never loads a half-written checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Protocol

from loom.contracts.wire import PolicyVersion


class PolicyStore:
    def __init__(self, root: str | Path, *, create: bool = True) -> None:
        """``create=False``: a reader that never makes the folder (the gateway's submission check)."""
        self.root = Path(root)
        if create:
            self.root.mkdir(parents=True, exist_ok=True)

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
        """Write version ``version`` with ``write(tmp_dir)`` and make it visible atomically."""
        final = self.path_of(version)
        if final.exists():
            raise FileExistsError(f"policy version {version} already exists at {final}")
        tmp = self.root / f".tmp-v{version}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        write(tmp)
        record = PolicyVersion(
            version=version,
            path=str(final),
            kind=kind,
            created_at=time.time(),
            meta=meta or {},
        )
        (tmp / "policy.json").write_text(record.model_dump_json(indent=2))
        os.replace(tmp, final)
        latest_tmp = self.root / f".LATEST-{os.getpid()}"
        latest_tmp.write_text(str(version))
        os.replace(latest_tmp, self.root / "LATEST")
        return record

    def manifest(self, version: int) -> dict[str, Any] | None:
        """Version ``version``'s record and files (``{"policy": ..., "files": [{path, size, sha256}]}``)
        or None. Hashed on the first request and kept as ``manifest.json`` in the version folder, so a
        deployment that never serves the store over HTTP never pays for the hashes."""
        record = self.get(version)
        if record is None:
            return None
        folder = self.path_of(version)
        stored = folder / MANIFEST
        if stored.exists():
            files = json.loads(stored.read_text())
        else:
            files = file_hashes(folder)
            tmp = folder / f".{MANIFEST}-{os.getpid()}"
            tmp.write_text(json.dumps(files, indent=1))
            os.replace(tmp, stored)
        return {"policy": record.model_dump(mode="json"), "files": files}

    def prune(self, keep: int = 3) -> list[int]:
        """Delete all but the newest ``keep`` versions; returns the deleted ones."""
        vs = self.versions()
        gone = vs[:-keep] if keep > 0 else vs
        for v in gone:
            shutil.rmtree(self.path_of(v), ignore_errors=True)
        return gone


MANIFEST = "manifest.json"


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
    """Every regular file under ``folder`` but the manifest itself (and hidden temporaries), with its
    path relative to ``folder``, size and sha256, sorted by path."""
    out = []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if (
            not p.is_file()
            or p.is_symlink()
            or rel == MANIFEST
            or any(x.startswith(".") for x in rel.split("/"))
        ):
            continue
        out.append({"path": rel, "size": p.stat().st_size, "sha256": sha256_of(p)})
    return out


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())
