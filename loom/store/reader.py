"""The interface the learner, the gateway and the rollout replicas read the policy store through.

Two implementations: ``PolicyStore`` (loom/store/local.py), the directory itself, and
``RemotePolicyStore`` (loom/store/remote.py), the same versions over HTTP pulled into a local
cache. A reader is one namespace's view (``name``; None: the learner's own versions, which the docs
call "loom"); ``namespace(name)`` is the same store's view of another. The lookups a request makes
name their namespace and version explicitly (``find``, ``loadable``), so the caller never composes
the store's rules itself: which version a request for ``(namespace, version, match)`` is served
(docs/interop-rollout.md), and what must be checked before its files are loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from loom.contracts.policies import PolicyMatch
from loom.contracts.wire import PolicyVersion


class PolicyReader(Protocol):
    root: Path  # where this namespace's version folders are on this host (a remote store's cache)
    name: str | None  # the namespace this view reads (None: the learner's)

    def namespace(self, name: str | None) -> PolicyReader:
        """The same store's view of namespace ``name``."""
        ...

    def get(self, version: int) -> PolicyVersion | None:
        """Version ``version`` of this namespace, exactly; None when the store does not hold it."""
        ...

    def latest(self) -> PolicyVersion | None:
        """This namespace's newest version; None when it holds none."""
        ...

    def find(
        self, namespace: str | None, version: int | None, match: PolicyMatch = "at_least"
    ) -> PolicyVersion | None:
        """The record a request for ``version`` of ``namespace`` is served (``resolve``)."""
        ...

    def loadable(
        self, namespace: str | None, version: int, match: PolicyMatch = "at_least"
    ) -> PolicyVersion | None:
        """``find``, with the version's files on this host and checked against its manifest (a
        remote store pulls them; a local store checks a registered path, which stays its trainer's).
        A file that is not the one hashed at publish is a ``PublishError`` or ``PolicyStoreError``."""
        ...


class _Versions(Protocol):
    def get(self, version: int) -> PolicyVersion | None: ...

    def latest(self) -> PolicyVersion | None: ...


class ReaderBase:
    """The lookups both readers answer the same way, from their own ``get``, ``latest`` and
    ``namespace`` (the directory reads its folders, the remote store asks its server)."""

    def namespace(self, name: str | None) -> ReaderBase:
        raise NotImplementedError

    def get(self, version: int) -> PolicyVersion | None:
        raise NotImplementedError

    def latest(self) -> PolicyVersion | None:
        raise NotImplementedError

    def serving(self, version: int) -> PolicyVersion | None:
        """What a replica asked for ``version`` loads: that version, or the newest one above it when
        it is gone (pruned); None when the store holds neither."""
        return serving_of(self, version)

    def find(
        self, namespace: str | None, version: int | None, match: PolicyMatch = "at_least"
    ) -> PolicyVersion | None:
        return resolve(self.namespace(namespace), version, match)


def serving_of(view: _Versions, version: int) -> PolicyVersion | None:
    """``version`` or, when it is gone (pruned), the newest version above it; else None."""
    found = view.get(version)
    if found is None:
        latest = view.latest()
        found = latest if latest is not None and latest.version >= version else None
    return found


def resolve(view: _Versions, version: int | None, match: PolicyMatch) -> PolicyVersion | None:
    """What a request for ``version`` gets from one namespace's ``view``: None asks for the newest;
    ``match`` "exact" that version only, "at_least" also a newer one when it is pruned (the rollout
    catch-up and the gateway's submission check decide alike, so a submission the gateway accepts is
    one every replica can serve)."""
    if version is None:
        return view.latest()
    return view.get(version) if match == "exact" else serving_of(view, version)
