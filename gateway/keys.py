"""API keys: hashed at rest, checked in constant time.

``LOOM_API_KEYS`` holds comma-separated ``name:sha256hex`` pairs, optionally ``name:sha256hex:scopes``
with ``scopes`` a ``+``-separated subset of ``jobs``, ``runs``, ``policy`` (publishing policy
versions, docs/interop-rollout.md), ``admin`` (default ``jobs+runs``), and optionally
``name:sha256hex:scopes:weight`` with ``weight`` the key's share of the rollout tier (a float > 0,
default 1.0: a key of weight 2 gets twice the generation slots of a key of weight 1 while both have
work waiting, gateway/scheduler.py).
Only the SHA-256 of a key is configured; the key itself is shown once by
``python -m gateway.keys new NAME [--scopes jobs+runs+admin] [--weight 2]``.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import math
import secrets
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from loom.contracts.policies import RUN_PREFIX

SCOPES: tuple[str, ...] = ("jobs", "runs", "policy", "admin")
DEFAULT_SCOPES: frozenset[str] = frozenset({"jobs", "runs"})
KEY_PREFIX = "loom_"
DEFAULT_WEIGHT = 1.0


def parse_weight(name: str, raw: str) -> float:
    """A key's weight: a finite float > 0 (a ValueError naming the key otherwise)."""
    try:
        weight = float(raw)
    except ValueError:
        raise ValueError(f"API key {name!r}: the weight must be a number > 0, got {raw!r}") from None
    if not (math.isfinite(weight) and weight > 0):
        raise ValueError(f"API key {name!r}: the weight must be a finite number > 0, got {raw!r}")
    return weight


@dataclass(frozen=True)
class ApiKey:
    name: str
    digest: bytes  # sha256 of the key
    scopes: frozenset[str]
    weight: float = DEFAULT_WEIGHT  # its share of the rollout tier (gateway/scheduler.py)


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
        if len(parts) not in (2, 3, 4) or not parts[0]:
            raise ValueError(f"API key entry {parts[0]!r}: expected name:sha256hex[:scopes[:weight]]")
        name, hexdigest = parts[0], parts[1].lower()
        if name.startswith(RUN_PREFIX):  # runs' lineages are namespaces of that form
            raise ValueError(f"API key {name!r}: a key's name must not start with {RUN_PREFIX!r}")
        if len(hexdigest) != 64 or any(c not in "0123456789abcdef" for c in hexdigest):
            raise ValueError(f"API key {name!r}: the hash must be 64 hex digits (sha256)")
        scopes = frozenset(parts[2].split("+")) if len(parts) >= 3 else DEFAULT_SCOPES
        unknown = scopes - set(SCOPES)
        if unknown:
            raise ValueError(f"API key {name!r}: unknown scopes {sorted(unknown)}")
        weight = parse_weight(name, parts[3]) if len(parts) == 4 else DEFAULT_WEIGHT
        keys.append(ApiKey(name=name, digest=bytes.fromhex(hexdigest), scopes=scopes, weight=weight))
    return keys


class KeyRing:
    def __init__(self, keys: Sequence[ApiKey]) -> None:
        self.keys = list(keys)

    @classmethod
    def from_spec(cls, spec: str) -> KeyRing:
        return cls(parse_keys(spec))

    def weights(self) -> dict[str, float]:
        """Each key's share of the rollout tier, by name."""
        return {key.name: key.weight for key in self.keys}

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
    for cmd in (new, h):
        cmd.add_argument(
            "--weight", default=None, help="the key's share of the rollout tier (a float > 0; default 1.0)"
        )
    args = p.parse_args(argv)
    key = new_key() if args.cmd == "new" else sys.stdin.readline().strip()
    entry = f"{args.name}:{hash_key(key)}"
    if args.scopes != "jobs+runs" or args.weight is not None:
        entry += f":{args.scopes}"
    if args.weight is not None:
        entry += f":{args.weight}"
    try:
        parse_keys(entry)  # validates name, scopes and weight
    except ValueError as exc:
        p.error(str(exc))
    if args.cmd == "new":
        print(f"key (shown once, store it now): {key}")
    print(f"LOOM_API_KEYS={entry}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
