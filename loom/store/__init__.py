"""The policy store: versioned policy checkpoints (full safetensors or LoRA adapters) in namespaces.

One interface for every reader (``PolicyReader``, loom/store/reader.py): the learner reads and
publishes its own lineage on the store's directory (``PolicyStore``), the gateway checks a submitted
version against it, and rollout replicas find and load the version a request names, from the
directory or over HTTP (``RemotePolicyStore``); ``open_policy_store`` picks one from the settings
(``LOOM_POLICY_STORE`` / ``LOOM_POLICY_STORE_URL``, docs/operations.md). Publishing trainers' versions
goes through a ``PolicyWriter`` (``policy_writer``). The package's modules, one concern each:

- ``layout``: paths, namespaces, version folders, ``LATEST``, opening files without links;
- ``manifest``: hashing and the manifest's reading and writing;
- ``local``: the directory store, the learner's publishing;
- ``uploads``: trainers' uploads in parts and registered paths, under a namespace lock;
- ``publish``: the writers (local, or forwarded to the store's host);
- ``remote``: the HTTP client, pulling into a cache, the cache's lock;
- ``routes``: the store host's FastAPI routes (imported by the service that mounts them only);
- ``errors``: the typed failures.

The wire contract for trainers stays in loom/contracts/policies.py.
"""

from __future__ import annotations

from loom.contracts.settings import Settings
from loom.store.errors import (
    IntegrityError,
    PolicyHashMismatch,
    PolicyManifestInvalid,
    PolicyPullTimeout,
    PolicyStoreError,
    PolicyStoreUnreachable,
    PublishConflict,
    PublishError,
    PublishForbidden,
    PublishNotFound,
    PublishUnavailable,
)
from loom.store.local import PolicyStore
from loom.store.publish import PolicyWriter, policy_writer
from loom.store.reader import PolicyReader
from loom.store.remote import RemotePolicyStore

__all__ = [
    "IntegrityError",
    "PolicyHashMismatch",
    "PolicyManifestInvalid",
    "PolicyPullTimeout",
    "PolicyReader",
    "PolicyStore",
    "PolicyStoreError",
    "PolicyStoreUnreachable",
    "PolicyWriter",
    "PublishConflict",
    "PublishError",
    "PublishForbidden",
    "PublishNotFound",
    "PublishUnavailable",
    "RemotePolicyStore",
    "open_policy_store",
    "policy_writer",
]


def open_policy_store(settings: Settings, *, create: bool = True) -> PolicyReader:
    """The store this process reads: the local directory (``LOOM_POLICY_STORE``) or, with
    ``LOOM_POLICY_STORE_URL``, the remote one cached under ``LOOM_POLICY_CACHE``. ``create=False``:
    a reader that writes nothing (the gateway: it reads records and never pulls files)."""
    if not settings.policy_store_url:
        return PolicyStore(settings.policy_store_path, create=create)
    return RemotePolicyStore(
        settings.policy_store_url,
        settings.policy_cache_path,
        token=settings.service_token,
        # a reader answers a submission: it waits for a manifest, never for a pull
        timeout_s=settings.policy_pull_timeout_s if create else min(settings.policy_pull_timeout_s, 10.0),
        pull=create,
    )
