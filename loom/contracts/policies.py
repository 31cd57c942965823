"""The policy-version contract for external trainers (docs/interop-rollout.md): what a trainer sends
to publish a version (an upload of its files, or a path it registers) and what Loom answers.

A version lives in a namespace: Loom's own learner publishes into the store's root (namespace None,
"loom" in the docs); a gateway key publishes into the namespace named after the key. Versions are
integers, numbered per namespace, and never change once committed.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath
from typing import Any, Literal

from pydantic import Field, field_validator

from loom.contracts.wire import Contract

PolicyKind = Literal["full", "lora"]
PolicyMatch = Literal["at_least", "exact"]

NAMESPACE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# the files a checkpoint or an adapter is made of: weights, configs, tokenizer files
FILE_SUFFIXES: tuple[str, ...] = (".safetensors", ".json", ".txt", ".model", ".tiktoken", ".jinja")
RESERVED_FILES = frozenset({"policy.json", "manifest.json"})  # the store's own records
MAX_FILES = 256
SHA256_RE = re.compile(r"[0-9a-f]{64}")


LEARNER_NAMESPACE = "loom"  # how PolicyRef and the docs name the learner's own versions (None in code)


RUN_PREFIX = "run-"  # a run's lineage: the namespace named after its id (gateway run ids start so)


def run_namespace(run_id: str) -> str:
    """The namespace a run trains in: its id, which starts with ``RUN_PREFIX``; key names cannot
    (gateway/keys.py), so a run's lineage is never a key's namespace."""
    if not run_id.startswith(RUN_PREFIX) or NAMESPACE_RE.fullmatch(run_id) is None:
        raise ValueError(f"{run_id!r} is not a run id")
    return run_id


def is_run_namespace(name: str | None) -> bool:
    return name is not None and name.startswith(RUN_PREFIX) and NAMESPACE_RE.fullmatch(name) is not None


def is_namespace(name: str | None) -> bool:
    """A trainer's namespace name (a key's name): letters, digits and ``_.-``, not "loom"."""
    return name is not None and name != LEARNER_NAMESPACE and NAMESPACE_RE.fullmatch(name) is not None


def file_path_problem(path: str) -> str | None:
    """Why ``path`` cannot be a file of a published version (None: it can): a relative POSIX path
    without ``..``, hidden parts or backslashes, ending in an allowed suffix, not a store record."""
    p = PurePosixPath(path)
    if (
        not path
        or "\\" in path
        or "\x00" in path
        or p.is_absolute()
        or any(part in ("", ".", "..") or part.startswith(".") for part in path.split("/"))
    ):
        return f"{path!r} is not a plain relative path"
    if len(path) > 255 or len(p.parts) > 4:
        return f"{path!r} is too long or too deep"
    if not path.endswith(FILE_SUFFIXES):
        return f"{path!r}: only {', '.join(FILE_SUFFIXES)} files are accepted"
    if path in RESERVED_FILES:
        return f"{path!r} is the store's own record"
    return None


class PolicyFile(Contract):
    path: str = Field(description="relative to the version's folder, e.g. model.safetensors")
    size: int = Field(ge=0)
    sha256: str = Field(description="64 lowercase hex digits")

    @field_validator("path")
    @classmethod
    def _plain(cls, v: str) -> str:
        problem = file_path_problem(v)
        if problem is not None:
            raise ValueError(problem)
        return v

    @field_validator("sha256")
    @classmethod
    def _hex(cls, v: str) -> str:
        if SHA256_RE.fullmatch(v) is None:
            raise ValueError("sha256 must be 64 lowercase hex digits")
        return v


class UploadRequest(Contract):
    """``POST /v1/policies/uploads``: the version's files, declared before any byte is sent."""

    kind: PolicyKind = "full"
    version: int | None = Field(
        default=None, ge=1, le=2**31, description="None: the namespace's next; else above its newest"
    )
    files: list[PolicyFile] = Field(min_length=1, max_length=MAX_FILES)
    meta: dict[str, Any] = Field(default_factory=dict, description="kept on the version (e.g. the step)")

    @field_validator("files")
    @classmethod
    def _distinct(cls, v: list[PolicyFile]) -> list[PolicyFile]:
        paths = [f.path for f in v]
        if len(set(paths)) != len(paths):
            raise ValueError("a file is declared twice")
        dirs = {str(parent) for f in v for parent in PurePosixPath(f.path).parents}
        if dirs & set(paths):
            raise ValueError("a declared file is also a folder of another")
        return v


class UploadTicket(Contract):
    upload_id: str
    namespace: str
    version: int


class RegisterRequest(Contract):
    """``POST /v1/policies/register``: a checkpoint folder on a filesystem the replicas share."""

    path: str = Field(min_length=1, max_length=4096, description="absolute, under an operator-set root")
    kind: PolicyKind = "full"
    version: int | None = Field(default=None, ge=1, le=2**31)
    meta: dict[str, Any] = Field(default_factory=dict)


class PolicyRef(Contract):
    """A published version as a trainer sees it (no server path)."""

    namespace: str
    version: int
    kind: PolicyKind
    files: list[dict[str, Any]] = Field(description="[{path, size, sha256}]")
    created_at: float
    registered: bool = Field(default=False, description="a registered path, not an upload")
