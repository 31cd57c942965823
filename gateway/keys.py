"""API keys: hashed at rest, checked in constant time.

``LOOM_API_KEYS`` holds comma-separated ``name:sha256hex`` pairs, optionally ``name:sha256hex:scopes``
with ``scopes`` a ``+``-separated subset of ``jobs``, ``runs``, ``policy`` (publishing policy
versions, docs/interop-rollout.md), ``admin`` (default ``jobs+runs``).
Only the SHA-256 of a key is configured; the key itself is shown once by
``python -m gateway.keys new NAME [--scopes jobs+runs+admin]``.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import secrets
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from loom.contracts.policies import RUN_PREFIX

SCOPES: tuple[str, ...] = ("jobs", "runs", "policy", "admin")
DEFAULT_SCOPES: frozenset[str] = frozenset({"jobs", "runs"})
KEY_PREFIX = "loom_"


@dataclass(frozen=True)
class ApiKey:
    name: str
    digest: bytes  # sha256 of the key
    scopes: frozenset[str]


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def parse_keys(spec: str) -> list[ApiKey]:
    """Parse ``LOOM_API_KEYS``; a malformed entry is an error (a silent skip would lock users out)."""
    keys: list[ApiKey] = []
    for raw in spec.split(","):
        entry = raw.strip()
        if not entry:
            continue
        parts = entry.split(":")
        if len(parts) not in (2, 3) or not parts[0]:
            raise ValueError(f"API key entry {parts[0]!r}: expected name:sha256hex[:scopes]")
        name, hexdigest = parts[0], parts[1].lower()
        if name.startswith(RUN_PREFIX):  # runs' lineages are namespaces of that form
            raise ValueError(f"API key {name!r}: a key's name must not start with {RUN_PREFIX!r}")
        if len(hexdigest) != 64 or any(c not in "0123456789abcdef" for c in hexdigest):
            raise ValueError(f"API key {name!r}: the hash must be 64 hex digits (sha256)")
        scopes = frozenset(parts[2].split("+")) if len(parts) == 3 else DEFAULT_SCOPES
        unknown = scopes - set(SCOPES)
        if unknown:
            raise ValueError(f"API key {name!r}: unknown scopes {sorted(unknown)}")
        keys.append(ApiKey(name=name, digest=bytes.fromhex(hexdigest), scopes=scopes))
    return keys


class KeyRing:
    def __init__(self, keys: Sequence[ApiKey]) -> None:
        self.keys = list(keys)

    @classmethod
    def from_spec(cls, spec: str) -> KeyRing:
        return cls(parse_keys(spec))

    def verify(self, presented: str) -> ApiKey | None:
        """The key whose hash matches, compared with ``hmac.compare_digest`` against every entry."""
        digest = hashlib.sha256(presented.encode()).digest()
        found: ApiKey | None = None
        for key in self.keys:  # no early exit: time does not depend on which entry matched
            if hmac.compare_digest(digest, key.digest):
                found = key
        return found


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gateway.keys", description="create a gateway API key")
    sub = p.add_subparsers(dest="cmd", required=True)
    new = sub.add_parser("new", help="print a new key once, and the LOOM_API_KEYS entry for it")
    new.add_argument("name")
    new.add_argument(
        "--scopes", default="jobs+runs", help="'+'-separated subset of jobs, runs, policy, admin"
    )
    h = sub.add_parser("hash", help="print the LOOM_API_KEYS entry of an existing key (read from stdin)")
    h.add_argument("name")
    h.add_argument("--scopes", default="jobs+runs")
    args = p.parse_args(argv)
    key = new_key() if args.cmd == "new" else sys.stdin.readline().strip()
    entry = f"{args.name}:{hash_key(key)}"
    if args.scopes != "jobs+runs":
        entry += f":{args.scopes}"
    parse_keys(entry)  # validates name and scopes
    if args.cmd == "new":
        print(f"key (shown once, store it now): {key}")
    print(f"LOOM_API_KEYS={entry}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
