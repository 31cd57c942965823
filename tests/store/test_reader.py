"""loom.store.reader's interface on the directory store: a lookup names its namespace and version,
and decides as the rollout catch-up and the gateway's submission check both need (exact, at least,
newest), whichever namespace's view it is asked of."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from loom.contracts.policies import RegisterRequest
from loom.store import IntegrityError, PolicyReader, PolicyStore
from loom.store.uploads import Uploads


def weights(fill: int) -> Callable[[Path], None]:
    def write(d: Path) -> None:
        (d / "model.safetensors").write_bytes(bytes([fill]) * 100)

    return write


@pytest.fixture
def store(tmp_path: Path) -> PolicyStore:
    store = PolicyStore(tmp_path / "policy")
    for version in (1, 2, 3):
        store.publish(version, weights(version))
    store.namespace("alice").publish(1, weights(9))
    return store


def version_of(found: object) -> int | None:
    return getattr(found, "version", None)


def test_find_exact_refuses_a_pruned_version_and_at_least_serves_the_newest_above(store: PolicyStore) -> None:
    store.prune(keep=1)  # 1 and 2 are gone
    assert store.find(None, 1, "exact") is None
    assert version_of(store.find(None, 1, "at_least")) == 3
    assert version_of(store.find(None, 3, "exact")) == 3
    assert store.find(None, 4) is None  # nothing newer: never an older one
    assert version_of(store.find(None, None)) == 3  # no version: the newest


def test_find_reads_the_namespace_it_names_whatever_view_it_is_asked_of(store: PolicyStore) -> None:
    alice = store.namespace("alice")
    mine = store.find("alice", 1, "exact")
    assert mine is not None and mine.namespace == "alice" and mine.path == str(alice.path_of(1))
    learners = alice.find(None, 2, "exact")
    assert learners is not None and learners.namespace is None and learners.path == str(store.path_of(2))
    assert store.find("alice", 2) is None  # alice's newest is 1: the learner's 3 is not hers
    assert store.find("bob", 1) is None and not (store.root / "ns" / "bob").exists()


def test_loadable_rehashes_a_registered_path_and_refuses_one_changed_since(
    store: PolicyStore, tmp_path: Path
) -> None:
    shared = tmp_path / "shared" / "step-7"
    shared.mkdir(parents=True)
    (shared / "model.safetensors").write_bytes(b"registered")
    uploads = Uploads(store, max_bytes=10**6, ttl_s=3600)
    uploads.register("carol", RegisterRequest(path=str(shared)), [tmp_path / "shared"])
    reader: PolicyReader = store  # what the rollout catch-up holds: the interface
    found = reader.loadable("carol", 1, "exact")
    assert found is not None and found.path == str(shared)
    (shared / "model.safetensors").write_bytes(b"registereD")  # same size, other bytes
    with pytest.raises(IntegrityError, match="model.safetensors"):
        reader.loadable("carol", 1, "exact")
    assert reader.find("carol", 1, "exact") is not None  # the record is there; its bytes are not


def test_loadable_of_a_version_in_the_store_is_what_find_serves(store: PolicyStore) -> None:
    store.prune(keep=1)
    found = store.loadable(None, 1)  # pruned: the newest above
    assert found is not None and found == store.find(None, 1) and found.path == str(store.path_of(3))
    assert store.loadable(None, 1, "exact") is None and store.loadable(None, 7) is None
