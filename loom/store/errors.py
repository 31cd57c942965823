"""The policy store's failures, as typed values (docs/operations.md, "The policy store over HTTP").

Two families: a ``PublishError`` is a refused publication or an integrity failure, carrying the HTTP
answer it becomes at the gateway's and the learner's routes; a ``PolicyStoreError`` is a remote
store that could not deliver a version it may hold (the rollout service answers 503, the gateway's
submission check too).
"""

from __future__ import annotations

from typing import Any


class PublishError(Exception):
    """A refused publication; ``status``/``error`` are the HTTP answer's (the gateway's and the
    learner's routes turn it into ``{"error", "detail"}``)."""

    status = 422
    error = "validation_error"

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail

    def body(self) -> dict[str, Any]:
        return {"error": self.error, "detail": self.detail}


class PublishConflict(PublishError):
    status, error = 409, "conflict"


class PublishNotFound(PublishError):
    status, error = 404, "not_found"


class IntegrityError(PublishError):
    """A file that is not the one hashed at publish (or not there, or a link)."""

    status, error = 422, "integrity_error"


class PublishForbidden(PublishError):
    status, error = 403, "forbidden"


class QuotaExceeded(PublishError):
    """A namespace's versions and uploads would hold more than its key's quota: waiting frees nothing,
    deleting a version or aborting an upload does (413, as a key's datasets, docs/security.md)."""

    status, error = 413, "quota_exceeded"

    def __init__(self, detail: str, *, quota: str, limit: int, requested: int, in_use: int) -> None:
        super().__init__(detail)
        self.extra = {"quota": quota, "limit": limit, "requested": requested, "in_use": in_use}

    def body(self) -> dict[str, Any]:
        return {**super().body(), **self.extra}


class PublishUnavailable(PublishError):
    """The store's host did not answer a forwarded publication."""

    status, error = 503, "policy_store_unavailable"


class PolicyStoreError(RuntimeError):
    """A remote store could not deliver a version it may hold."""


class PolicyStoreUnreachable(PolicyStoreError):
    """No answer from the store's URL, or an answer that is not the store's (5xx, 401)."""


class PolicyPullTimeout(PolicyStoreError):
    """The pull took longer than ``timeout_s`` (LOOM_POLICY_PULL_TIMEOUT_S)."""


class PolicyHashMismatch(PolicyStoreError):
    """A pulled file's size or sha256 is not the manifest's; nothing of the version is kept."""


class PolicyManifestInvalid(PolicyStoreError):
    """A manifest that names a path outside its version folder, or is not a manifest at all."""
