"""A version's manifest: every file's path, size and sha256, computed once at publish.

What a replica pulls, and what a replica reading a registered path loads, is checked against these
bytes (docs/operations.md, "The policy store over HTTP"). The trainer-facing publisher
(loom/clients/policies.py) hashes its files with the same functions before it declares them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import IO, Any

from loom.contracts.wire import PolicyVersion
from loom.store.errors import PolicyManifestInvalid
from loom.store.layout import MANIFEST, RECORD

CHUNK = 1 << 20


def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hash_stream(f)[1]


def hash_stream(src: IO[bytes]) -> tuple[int, str]:
    """The size and sha256 of what is left to read in ``src``."""
    h, size = hashlib.sha256(), 0
    while chunk := src.read(CHUNK):
        h.update(chunk)
        size += len(chunk)
    return size, h.hexdigest()


def not_a_record(rel: str) -> bool:
    """Whether ``rel`` is a checkpoint's file rather than one of the store's own records."""
    return rel not in (MANIFEST, RECORD)


def file_hashes(folder: Path, keep: Callable[[str], bool] = not_a_record) -> list[dict[str, Any]]:
    """Every regular file under ``folder`` whose relative path ``keep`` accepts (by default: all but
    the store's records), hidden ones (temporaries) left out, with its path relative to ``folder``,
    size and sha256, sorted by path. A link is never followed."""
    out = []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if (
            not p.is_file()
            or p.is_symlink()
            or not keep(rel)
            or any(x.startswith(".") for x in rel.split("/"))
        ):
            continue
        out.append({"path": rel, "size": p.stat().st_size, "sha256": sha256_of(p)})
    return out


def write_records(folder: Path, record: PolicyVersion, files: list[dict[str, Any]]) -> None:
    """A version folder's two records: its PolicyVersion and its manifest."""
    (folder / RECORD).write_text(record.model_dump_json(indent=2))
    (folder / MANIFEST).write_text(json.dumps(files, indent=1))


def read_files(folder: Path) -> list[dict[str, Any]] | None:
    """The manifest's files as written at publish; None when the folder holds no manifest."""
    stored = folder / MANIFEST
    if not stored.is_file():
        return None
    files: list[dict[str, Any]] = json.loads(stored.read_text())
    return files


def checked_files(manifest: Any) -> list[dict[str, Any]]:
    """A manifest that came over the wire (``{"policy", "files"}``): its files, each a plain relative
    path inside the version folder; ``PolicyManifestInvalid`` for anything else."""
    try:
        files: list[dict[str, Any]] = [
            {"path": str(f["path"]), "size": int(f["size"]), "sha256": str(f["sha256"])}
            for f in manifest["files"]
        ]
        PolicyVersion.model_validate(manifest["policy"])
    except (KeyError, TypeError, ValueError) as exc:
        raise PolicyManifestInvalid(f"not a policy manifest: {exc}") from exc
    for f in files:
        p = PurePosixPath(f["path"])
        if (
            p.is_absolute()
            or not p.parts
            or any(part in ("", ".", "..") or part.startswith(".") for part in p.parts)
        ):
            raise PolicyManifestInvalid(f"manifest path {f['path']!r} is not inside the version folder")
    return files
