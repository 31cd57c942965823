"""The policy store over HTTP, for replicas that share no filesystem with the learner.

Server: ``add_store_routes(app, guard)`` mounts three read-only internal routes on a service that
holds the store directory (the learner API; ``LOOM_SERVICE_TOKEN`` guards them like the other
internal routes):

- ``GET /v1/store/latest``: ``{"version": N}`` of the newest version (404 when there is none);
- ``GET /v1/store/v/{version}/manifest``: ``{"policy": PolicyVersion, "files": [{path, size, sha256}]}``;
- ``GET /v1/store/v/{version}/files/{path}``: one file the manifest lists, streamed (any other: 404).

Client: ``RemotePolicyStore`` reads the same versions as ``PolicyStore`` and pulls a version into a
local cache directory the first time it is asked for: every file is streamed into a temporary folder,
its size and sha256 checked against the manifest, and the folder renamed to ``<cache>/v<N>`` only
when complete (a crash leaves no half version). Workers on one host that want the same version take
turns on a lock file, so it is downloaded once. A pull is bounded by ``timeout_s``; failures are
``PolicyStoreError`` subclasses. ``open_policy_store`` picks the local or the remote store from the
settings (``LOOM_POLICY_STORE_URL``; docs/operations.md).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
import uuid
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

import httpx
from fastapi import FastAPI, HTTPException
from fastapi.responses import FileResponse

from loom.contracts.settings import Settings
from loom.contracts.wire import PolicyVersion
from loom.service import ErrorBody
from loom.service_token import UNAUTHORIZED, service_headers
from loom.store import MANIFEST, PolicyStore, serving_of


class PolicyReader(Protocol):
    """What the rollout catch-up and the gateway's submission check read (both stores have it)."""

    root: Path

    def get(self, version: int) -> PolicyVersion | None: ...

    def latest(self) -> PolicyVersion | None: ...

    def serving(self, version: int) -> PolicyVersion | None: ...


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


# --------------------------------------------------------------------------------------------------
# server


def add_store_routes(app: FastAPI, guard: Any) -> None:
    """Mount the store routes on ``app``; they serve ``app.state.settings.policy_store_path``."""

    def store() -> PolicyStore:
        return PolicyStore(app.state.settings.policy_store_path, create=False)

    answers: dict[int | str, dict[str, Any]] = {
        **UNAUTHORIZED,
        404: {"model": ErrorBody, "description": "no such version (or file) in the policy store"},
    }

    def manifest_or_404(version: int) -> dict[str, Any]:
        found = store().manifest(version) if store().root.is_dir() else None
        if found is None:
            raise HTTPException(404, {"error": "not_found", "detail": f"no policy version {version}"})
        return found

    @app.get("/v1/store/latest", tags=["store"], dependencies=[guard], responses=answers)
    async def latest() -> dict[str, int]:
        found = store().latest() if store().root.is_dir() else None
        if found is None:
            raise HTTPException(404, {"error": "not_found", "detail": "the policy store holds no version"})
        return {"version": found.version}

    @app.get("/v1/store/v/{version}/manifest", tags=["store"], dependencies=[guard], responses=answers)
    def manifest(version: int) -> dict[str, Any]:  # sync: hashing an old version runs off the loop
        return manifest_or_404(version)

    @app.get(
        "/v1/store/v/{version}/files/{path:path}",
        tags=["store"],
        dependencies=[guard],
        responses=answers,
        response_class=FileResponse,
    )
    def file(version: int, path: str) -> FileResponse:
        listed = {f["path"] for f in manifest_or_404(version)["files"]}
        if path not in listed:  # only what the manifest names: no path is resolved from the request
            raise HTTPException(404, {"error": "not_found", "detail": f"version {version} has no {path}"})
        return FileResponse(store().path_of(version) / path, media_type="application/octet-stream")


# --------------------------------------------------------------------------------------------------
# client


class RemotePolicyStore:
    def __init__(
        self, url: str, cache: str | Path, *, token: str = "", timeout_s: float = 600.0, pull: bool = True
    ) -> None:
        """``pull=False``: answer from the manifests alone (records keep the server's paths)."""
        self.url = url.rstrip("/")
        self.root = Path(cache)
        self.timeout_s = timeout_s
        self.pull = pull
        self._headers = service_headers(token)
        if pull:
            self.root.mkdir(parents=True, exist_ok=True)

    def path_of(self, version: int) -> Path:
        return self.root / f"v{version}"

    def cached(self, version: int) -> PolicyVersion | None:
        meta = self.path_of(version) / "policy.json"
        return PolicyVersion.model_validate_json(meta.read_text()) if meta.exists() else None

    def latest(self) -> PolicyVersion | None:
        body = self._get_json("/v1/store/latest", time.monotonic() + self.timeout_s)
        return None if body is None else self.get(int(body["version"]))

    def serving(self, version: int) -> PolicyVersion | None:
        return serving_of(self, version)

    def get(self, version: int) -> PolicyVersion | None:
        if self.pull and (found := self.cached(version)) is not None:
            return found
        deadline = time.monotonic() + self.timeout_s
        manifest = self._get_json(f"/v1/store/v/{version}/manifest", deadline)
        if manifest is None:
            return None
        files = _checked_files(manifest)
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
            tmp = self.root / f".tmp-v{version}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            try:
                tmp.mkdir()
                for f in files:
                    self._download(version, f, tmp, deadline)
                record = PolicyVersion.model_validate(manifest["policy"])
                record = record.model_copy(update={"path": str(self.path_of(version))})
                (tmp / "policy.json").write_text(record.model_dump_json(indent=2))
                (tmp / MANIFEST).write_text(json.dumps(files, indent=1))
                os.rename(tmp, self.path_of(version))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return record

    def _download(self, version: int, f: dict[str, Any], into: Path, deadline: float) -> None:
        target = into / f["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        h = hashlib.sha256()
        size = 0
        url = f"{self.url}/v1/store/v/{version}/files/{f['path']}"
        try:
            with (
                httpx.stream("GET", url, headers=self._headers, timeout=_timeout(deadline)) as resp,
                open(target, "wb") as out,
            ):
                _raise_for(resp, url)
                for chunk in resp.iter_bytes(1 << 20):
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


def _timeout(deadline: float) -> httpx.Timeout:
    left = deadline - time.monotonic()
    if left <= 0:
        raise PolicyPullTimeout("the pull's time is up")
    return httpx.Timeout(min(left, 60.0))


def _raise_for(resp: httpx.Response, url: str) -> None:
    if resp.status_code != 200:
        raise PolicyStoreUnreachable(f"{url} answered {resp.status_code}")


def _checked_files(manifest: Any) -> list[dict[str, Any]]:
    """The manifest's files, each a plain relative path inside the version folder."""
    try:
        files: list[dict[str, Any]] = [
            {"path": str(f["path"]), "size": int(f["size"]), "sha256": str(f["sha256"])}
            for f in manifest["files"]
        ]
        PolicyVersion.model_validate(manifest["policy"])
    except (KeyError, TypeError, ValueError) as exc:
        raise PolicyManifestInvalid(f"not a policy manifest: {exc}") from exc
    for f in files:
        p = PurePosixPath(f["path"])
        if (
            p.is_absolute()
            or not p.parts
            or any(part in ("", ".", "..") or part.startswith(".") for part in p.parts)
        ):
            raise PolicyManifestInvalid(f"manifest path {f['path']!r} is not inside the version folder")
    return files


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
