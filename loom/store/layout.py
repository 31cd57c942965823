"""Where a policy store keeps what: the one place that knows the folder layout.

``<root>/v<version>/`` holds a version's checkpoint, ``policy.json`` (its PolicyVersion record) and
``manifest.json`` (each file's size and sha256, written at publish); ``<root>/LATEST`` names the
newest complete version. Loom's learner publishes into the root (namespace None); a trainer's
versions live in ``<root>/ns/<name>/`` with the same layout (docs/interop-rollout.md). A replica's
cache of pulled versions (loom/store/remote.py) uses the same layout under its own root.
"""

from __future__ import annotations

import os
import re
import stat
import uuid
from pathlib import Path
from typing import IO

from loom.contracts.wire import PolicyVersion

RECORD = "policy.json"  # a version's PolicyVersion
MANIFEST = "manifest.json"  # a version's files: [{path, size, sha256}]
LATEST = "LATEST"
FLOOR = "FLOOR"  # the newest version number a namespace ever had: a deleted one is never reused
NAMESPACES = "ns"  # <root>/ns/<name>/: a trainer's versions
UPLOADS = ".uploads"  # <root>/.uploads/<id>/: uploads not yet committed (loom/store/uploads.py)
REGISTERED = "registered"  # meta key: the version's files are at its path, on a shared filesystem
VERSION_DIR = re.compile(r"v\d+")


def namespace_root(base: Path, namespace: str | None) -> Path:
    """The folder of ``namespace``'s versions under the store's ``base`` (None: the learner's)."""
    return base if namespace is None else base / NAMESPACES / namespace


def namespace_parts(namespace: str | None) -> list[str]:
    """``namespace_root``'s components below ``base`` (opened one by one by ``open_no_follow``)."""
    return [] if namespace is None else [NAMESPACES, namespace]


def version_dir(root: Path, version: int) -> Path:
    return root / f"v{version}"


def temporary(root: Path, version: int, tag: str = "") -> Path:
    """A hidden folder next to version ``version``'s, renamed to it when complete (a reader never
    sees half a version); ``tag`` names its writer, else this process and a random part."""
    return root / f".tmp-v{version}-{tag or f'{os.getpid()}-{uuid.uuid4().hex[:8]}'}"


def versions_in(root: Path) -> list[int]:
    """The complete versions under ``root`` (a folder ``v<N>`` with its record), oldest first."""
    out = []
    for p in root.glob("v*"):
        if p.is_dir() and p.name[1:].isdigit() and (p / RECORD).exists():
            out.append(int(p.name[1:]))
    return sorted(out)


def read_record(root: Path, version: int) -> PolicyVersion | None:
    meta = version_dir(root, version) / RECORD
    return PolicyVersion.model_validate_json(meta.read_text()) if meta.exists() else None


def read_latest(root: Path) -> int | None:
    """The version ``<root>/LATEST`` names, or None when there is no marker."""
    marker = root / LATEST
    return int(marker.read_text().strip()) if marker.exists() else None


def read_floor(root: Path) -> int:
    """The newest version ``root`` ever held (``FLOOR``, written when one is deleted), 0 without one."""
    marker = root / FLOOR
    return int(marker.read_text().strip()) if marker.exists() else 0


def write_floor(root: Path, version: int) -> None:
    tmp = root / f".FLOOR-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.write_text(str(max(version, read_floor(root))))
    os.replace(tmp, root / FLOOR)


def write_latest(root: Path, version: int) -> None:
    tmp = root / f".LATEST-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.write_text(str(version))
    os.replace(tmp, root / LATEST)


def version_named(root: Path, path: str) -> int | None:
    """The version whose folder ``path`` names (relative to ``root`` or absolute), or None when it
    names anything but a version folder directly under ``root``. Decided on the path's text and the
    store's own links only (``..`` is resolved lexically, and a link in the store that points out is
    refused), so the answer says nothing of what exists elsewhere."""
    top = root.resolve()
    given = Path(os.path.normpath(top / path))

    def inside(p: Path) -> bool:
        return p.parent == top and VERSION_DIR.fullmatch(p.name) is not None

    if not inside(given) or not inside(given.resolve()):
        return None
    return int(given.name[1:])


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
