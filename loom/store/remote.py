"""The policy store over HTTP, for replicas that share no filesystem with the learner.

``RemotePolicyStore`` reads the versions a store host serves (loom/store/routes.py, mounted on the
learner API) and pulls a version into a local cache directory the first time it is asked for: every
file is streamed into a temporary folder, its size and sha256 checked against the manifest, and the
folder renamed to ``<cache>/v<N>`` (``<cache>/ns/<name>/v<N>`` for a trainer's) only when complete, so
a crash leaves no half version. Workers on one host that want the same version take turns on a lock
file (``<cache>/.pull-v<N>.lock``), so it is downloaded once. A pull is bounded by ``timeout_s``;
failures are ``PolicyStoreError`` subclasses (docs/operations.md, "The policy store over HTTP").
``open_policy_store`` picks the directory or this client from the settings, as ``policy_writer``
(loom/store/publish.py) picks a writer.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import time
from pathlib import Path
from typing import Any

import httpx

from loom.contracts.policies import PolicyMatch, is_namespace
from loom.contracts.settings import Settings
from loom.contracts.wire import PolicyVersion
from loom.service_token import service_headers
from loom.store.errors import (
    PolicyHashMismatch,
    PolicyManifestInvalid,
    PolicyPullTimeout,
    PolicyStoreUnreachable,
)
from loom.store.layout import REGISTERED, namespace_root, read_record, temporary, version_dir
from loom.store.local import PolicyStore
from loom.store.manifest import CHUNK, checked_files, write_records
from loom.store.reader import PolicyReader, ReaderBase


class RemotePolicyStore(ReaderBase):
    def __init__(
        self,
        url: str,
        cache: str | Path,
        *,
        token: str = "",
        timeout_s: float = 600.0,
        pull: bool = True,
        namespace: str | None = None,
    ) -> None:
        """``pull=False``: answer from the manifests alone (records keep the server's paths; the
        gateway's submission check). ``namespace``: a trainer's versions (cached under
        ``<cache>/ns/<name>``)."""
        if namespace is not None and not is_namespace(namespace):
            raise ValueError(f"{namespace!r} is not a policy namespace name")
        self.url = url.rstrip("/")
        self.cache = Path(cache)
        self.name = namespace
        self.root = namespace_root(self.cache, namespace)
        self.prefix = "/v1/store" if namespace is None else f"/v1/store/ns/{namespace}"
        self.timeout_s = timeout_s
        self.pull = pull
        self._token = token
        self._headers = service_headers(token)
        if pull:
            self.root.mkdir(parents=True, exist_ok=True)

    def namespace(self, name: str | None) -> RemotePolicyStore:
        return RemotePolicyStore(
            self.url, self.cache, token=self._token, timeout_s=self.timeout_s, pull=self.pull, namespace=name
        )

    def path_of(self, version: int) -> Path:
        return version_dir(self.root, version)

    def cached(self, version: int) -> PolicyVersion | None:
        return read_record(self.root, version)

    def latest(self) -> PolicyVersion | None:
        body = self._get_json(f"{self.prefix}/latest", time.monotonic() + self.timeout_s)
        return None if body is None else self.get(int(body["version"]))

    def loadable(
        self, namespace: str | None, version: int, match: PolicyMatch = "at_least"
    ) -> PolicyVersion | None:
        """``find``: pulling checks every file against the manifest on its way into the cache."""
        if not self.pull:
            raise ValueError("a reader that never pulls has no files to load")
        return self.find(namespace, version, match)

    def get(self, version: int) -> PolicyVersion | None:
        if self.pull and (found := self.cached(version)) is not None:
            return found
        deadline = time.monotonic() + self.timeout_s
        manifest = self._get_json(f"{self.prefix}/v/{version}/manifest", deadline)
        if manifest is None:
            return None
        files = checked_files(manifest)
        if not self.pull:
            return PolicyVersion.model_validate(manifest["policy"])
        return self._pull(version, manifest, files, deadline)

    def _pull(
        self, version: int, manifest: dict[str, Any], files: list[dict[str, Any]], deadline: float
    ) -> PolicyVersion:
        with _locked(self.root / f".pull-v{version}.lock", deadline):
            if (found := self.cached(version)) is not None:  # another worker on this host pulled it
                return found
            for stale in self.root.glob(f".tmp-v{version}-*"):  # a pull killed mid-way (we hold the lock)
                shutil.rmtree(stale, ignore_errors=True)
            tmp = temporary(self.root, version)
            try:
                tmp.mkdir()
                for f in files:
                    self._download(version, f, tmp, deadline)
                record = PolicyVersion.model_validate(manifest["policy"])
                record = record.model_copy(
                    update={"path": str(self.path_of(version)), "meta": local_meta(record)}
                )
                write_records(tmp, record, files)
                os.rename(tmp, self.path_of(version))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return record

    def _download(self, version: int, f: dict[str, Any], into: Path, deadline: float) -> None:
        target = into / f["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        h = hashlib.sha256()
        size = 0
        url = f"{self.url}{self.prefix}/v/{version}/files/{f['path']}"
        try:
            with (
                httpx.stream("GET", url, headers=self._headers, timeout=_timeout(deadline)) as resp,
                open(target, "wb") as out,
            ):
                _raise_for(resp, url)
                for chunk in resp.iter_bytes(CHUNK):
                    if time.monotonic() > deadline:
                        raise PolicyPullTimeout(
                            f"pulling policy version {version} took over {self.timeout_s} s"
                        )
                    h.update(chunk)
                    size += len(chunk)
                    out.write(chunk)
        except httpx.TimeoutException as exc:
            raise PolicyPullTimeout(f"pulling policy version {version} took over {self.timeout_s} s") from exc
        except httpx.HTTPError as exc:
            raise PolicyStoreUnreachable(f"{url}: {exc}") from exc
        if size != f["size"] or h.hexdigest() != f["sha256"]:
            raise PolicyHashMismatch(
                f"policy version {version}: {f['path']} has {size} bytes, sha256 {h.hexdigest()}; "
                f"the manifest says {f['size']} bytes, sha256 {f['sha256']}"
            )

    def _get_json(self, route: str, deadline: float) -> Any:
        """The route's JSON body, or None on 404."""
        url = self.url + route
        try:
            resp = httpx.get(url, headers=self._headers, timeout=_timeout(deadline))
        except httpx.TimeoutException as exc:
            raise PolicyPullTimeout(f"{url}: no answer in {self.timeout_s} s") from exc
        except httpx.HTTPError as exc:
            raise PolicyStoreUnreachable(f"{url}: {exc}") from exc
        if resp.status_code == 404:
            return None
        _raise_for(resp, url)
        try:
            return resp.json()
        except ValueError as exc:
            raise PolicyManifestInvalid(f"{url}: not JSON") from exc


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


def local_meta(record: PolicyVersion) -> dict[str, Any]:
    """A pulled version's meta: its files are in the cache now, not at a registered path."""
    return {k: v for k, v in record.meta.items() if k != REGISTERED}


def _timeout(deadline: float) -> httpx.Timeout:
    left = deadline - time.monotonic()
    if left <= 0:
        raise PolicyPullTimeout("the pull's time is up")
    return httpx.Timeout(min(left, 60.0))


def _raise_for(resp: httpx.Response, url: str) -> None:
    if resp.status_code != 200:
        raise PolicyStoreUnreachable(f"{url} answered {resp.status_code}")


class _locked:
    """An exclusive ``flock`` on ``path``, waited for until ``deadline`` (workers of one host)."""

    def __init__(self, path: Path, deadline: float) -> None:
        self.path, self.deadline = path, deadline

    def __enter__(self) -> None:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > self.deadline:
                    os.close(self.fd)
                    raise PolicyPullTimeout(
                        f"another process held {self.path} past the pull's time"
                    ) from None
                time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
