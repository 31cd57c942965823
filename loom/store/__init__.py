"""The policy store: versioned policy checkpoints (full safetensors or LoRA adapters) in namespaces.

One interface for every reader (``PolicyReader``, loom/store/reader.py): the learner reads and
publishes its own lineage on the store's directory (``PolicyStore``), the gateway checks a submitted
version against it, and rollout replicas find and load the version a request names, from the
directory or over HTTP (``RemotePolicyStore``); ``open_policy_store`` picks one from the settings
(``LOOM_POLICY_STORE`` / ``LOOM_POLICY_STORE_URL``, docs/operations.md). Publishing trainers' versions
goes through a ``PolicyWriter`` (``policy_writer``). The package's modules, one concern each:

- ``reader``: the interface and the rule of which version a request is served;
- ``layout``: paths, namespaces, version folders, ``LATEST``, opening files without links;
- ``manifest``: hashing and the manifest's reading and writing;
- ``local``: the directory store, the learner's publishing;
- ``uploads``: trainers' uploads in parts and registered paths, under a namespace lock; the
  namespace's quota, aborting, deleting;
- ``checks``: a version's config and safetensors headers bounded by the deployment's base model;
- ``publish``: the writers (local, or forwarded to the store's host);
- ``remote``: the HTTP client, pulling into a cache, the cache's lock; ``open_policy_store``;
- ``routes``: the store host's FastAPI routes (imported by the service that mounts them only);
- ``errors``: the typed failures.

The wire contract for trainers stays in loom/contracts/policies.py.
"""

from __future__ import annotations

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
from loom.store.remote import RemotePolicyStore, open_policy_store

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
