"""The policy store over HTTP, for replicas that share no filesystem with the learner.

Server: ``add_store_routes(app, guard)`` mounts three read-only internal routes on a service that
holds the store directory (the learner API; ``LOOM_SERVICE_TOKEN`` guards them like the other
internal routes), the same three for a trainer's namespace under ``/v1/store/ns/{namespace}``:

- ``GET /v1/store/latest``: ``{"version": N}`` of the newest version (404 when there is none);
- ``GET /v1/store/v/{version}/manifest``: ``{"policy": PolicyVersion, "files": [{path, size, sha256}]}``
  (the manifest written at publish; a version without one is a 404);
- ``GET /v1/store/v/{version}/files/{path}``: one file the manifest lists, streamed, opened without
  following a link (any other: 404);

and the publishing routes the gateway forwards a trainer's uploads to (``add_publish_routes``;
``policy_writer`` picks the local store or the forwarding writer, docs/interop-rollout.md).

Client: ``RemotePolicyStore`` reads the same versions as ``PolicyStore`` and pulls a version into a
local cache directory the first time it is asked for: every file is streamed into a temporary folder,
its size and sha256 checked against the manifest, and the folder renamed to ``<cache>/v<N>`` only
when complete (a crash leaves no half version). Workers on one host that want the same version take
turns on a lock file, so it is downloaded once. A pull is bounded by ``timeout_s``; failures are
``PolicyStoreError`` subclasses. ``open_policy_store`` picks the local or the remote store from the
settings (``LOOM_POLICY_STORE_URL``; docs/operations.md).
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any, Protocol, TypeVar

import httpx
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import StreamingResponse

from loom.contracts.errors import ErrorBody
from loom.contracts.policies import PolicyRef, RegisterRequest, UploadRequest, UploadTicket, is_namespace
from loom.contracts.settings import Settings
from loom.contracts.wire import PolicyVersion
from loom.service_token import UNAUTHORIZED, service_headers
from loom.store import (
    MANIFEST,
    NAMESPACES,
    REGISTERED,
    IntegrityError,
    PolicyStore,
    PublishConflict,
    PublishError,
    PublishForbidden,
    PublishNotFound,
    Uploads,
    serving_of,
)


class PolicyReader(Protocol):
    """What the rollout catch-up and the gateway's submission check read (both stores have it)."""

    root: Path

    def namespace(self, name: str | None) -> PolicyReader: ...

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


def _store(app: FastAPI, namespace: str | None) -> PolicyStore:
    """The store a read route serves (the learner's, or ``namespace``'s: a 404 for a malformed one)."""
    if namespace is not None and not is_namespace(namespace):
        raise HTTPException(404, {"error": "not_found", "detail": "no such namespace"})
    return PolicyStore(app.state.settings.policy_store_path, create=False, namespace=namespace)


def _manifest_or_404(app: FastAPI, namespace: str | None, version: int) -> dict[str, Any]:
    s = _store(app, namespace)
    found = s.manifest(version) if s.root.is_dir() else None
    if found is None:
        raise HTTPException(404, {"error": "not_found", "detail": f"no policy version {version}"})
    return found


def _latest_of(app: FastAPI, namespace: str | None) -> dict[str, int]:
    s = _store(app, namespace)
    found = s.latest() if s.root.is_dir() else None
    if found is None:
        raise HTTPException(404, {"error": "not_found", "detail": "the policy store holds no version"})
    return {"version": found.version}


def _file_of(app: FastAPI, namespace: str | None, version: int, path: str) -> StreamingResponse:
    listed = {f["path"]: f for f in _manifest_or_404(app, namespace, version)["files"]}
    if path not in listed:  # only what the manifest names: no path is resolved from the request
        raise HTTPException(404, {"error": "not_found", "detail": f"version {version} has no {path}"})
    try:
        with _store(app, namespace).open_file(version, path) as f:
            fd = os.dup(f.fileno())
    except FileNotFoundError:  # a link, or no longer a regular file: never served
        raise HTTPException(
            404, {"error": "not_found", "detail": f"version {version} has no {path}"}
        ) from None
    out = os.fdopen(fd, "rb")
    size = os.fstat(fd).st_size

    def chunks() -> Iterator[bytes]:
        with out:
            while chunk := out.read(1 << 20):
                yield chunk

    return StreamingResponse(
        chunks(), media_type="application/octet-stream", headers={"Content-Length": str(size)}
    )


def add_store_routes(app: FastAPI, guard: Any) -> None:
    """Mount the store routes on ``app``; they serve ``app.state.settings.policy_store_path``: the
    learner's versions under ``/v1/store``, a trainer's under ``/v1/store/ns/{namespace}``, and the
    internal publishing routes the gateway forwards its ``/v1/policies`` uploads to."""

    answers: dict[int | str, dict[str, Any]] = {
        **UNAUTHORIZED,
        404: {"model": ErrorBody, "description": "no such version (or file) in the policy store"},
    }

    for prefix, namespace_of, name in (
        ("/v1/store", _learner_namespace, ""),
        ("/v1/store/ns/{namespace}", _trainer_namespace, "ns_"),
    ):
        _add_read_routes(app, guard, answers, prefix, namespace_of, name)

    add_publish_routes(app, guard)


def _learner_namespace() -> None:
    """The read routes under ``/v1/store``: the learner's own versions (no namespace)."""
    return None


def _trainer_namespace(namespace: str) -> str:
    """The read routes under ``/v1/store/ns/{namespace}``: a trainer's versions."""
    return namespace


def _add_read_routes(
    app: FastAPI,
    guard: Any,
    answers: dict[int | str, dict[str, Any]],
    prefix: str,
    namespace_of: Callable[..., str | None],
    name: str,
) -> None:
    """The three read routes under ``prefix``, serving the namespace ``namespace_of`` reads (a path
    parameter, or none); ``name`` prefixes the routes' names."""
    get = functools.partial(app.get, tags=["store"], dependencies=[guard])
    file_answers = {**answers, 200: {"content": {"application/octet-stream": {}}}}

    @get(f"{prefix}/latest", responses=answers, name=f"{name}latest")
    def latest(namespace: str | None = Depends(namespace_of)) -> dict[str, int]:
        return _latest_of(app, namespace)

    @get(f"{prefix}/v/{{version}}/manifest", responses=answers, name=f"{name}manifest")
    def manifest(version: int, namespace: str | None = Depends(namespace_of)) -> dict[str, Any]:
        return _manifest_or_404(app, namespace, version)

    @get(
        f"{prefix}/v/{{version}}/files/{{path:path}}",
        responses=file_answers,
        response_class=StreamingResponse,
        name=f"{name}file",
    )
    def file(version: int, path: str, namespace: str | None = Depends(namespace_of)) -> StreamingResponse:
        return _file_of(app, namespace, version, path)


def add_publish_routes(app: FastAPI, guard: Any) -> None:
    """The internal publishing routes (``/v1/store/ns/{namespace}/...``): the gateway, which checked
    the key, its ``policy`` scope and its namespace, forwards a trainer's upload here when the store
    is on another host (``LOOM_POLICY_STORE_URL``)."""
    prefix = "/v1/store/ns/{namespace}"
    answers: dict[int | str, dict[str, Any]] = {
        **UNAUTHORIZED,
        **{s: {"model": ErrorBody} for s in (403, 404, 409, 422)},
    }

    def writer() -> LocalPolicyWriter:
        return LocalPolicyWriter.from_settings(app.state.settings)

    @app.post(f"{prefix}/uploads", tags=["store"], dependencies=[guard], responses=answers, status_code=201)
    async def declare(namespace: str, body: UploadRequest) -> UploadTicket:
        return await answer(writer().declare(namespace, body))

    @app.put(
        f"{prefix}/uploads/{{upload_id}}/files/{{path:path}}",
        tags=["store"],
        dependencies=[guard],
        responses=answers,
    )
    async def put(
        namespace: str, upload_id: str, path: str, request: Request, offset: int = 0
    ) -> dict[str, int]:
        return {"received": await answer(writer().put(namespace, upload_id, path, offset, request.stream()))}

    @app.post(
        f"{prefix}/uploads/{{upload_id}}/commit",
        tags=["store"],
        dependencies=[guard],
        responses=answers,
        status_code=201,
    )
    async def commit(namespace: str, upload_id: str) -> PolicyRef:
        return await answer(writer().commit(namespace, upload_id))

    @app.post(f"{prefix}/register", tags=["store"], dependencies=[guard], responses=answers, status_code=201)
    async def register(namespace: str, body: RegisterRequest) -> PolicyRef:
        return await answer(writer().register(namespace, body))

    @app.get(f"{prefix}/refs", tags=["store"], dependencies=[guard], responses=answers)
    async def refs(namespace: str) -> list[PolicyRef]:
        return await answer(writer().refs(namespace))


T = TypeVar("T")


async def answer(work: Awaitable[T]) -> T:
    """``work``'s result, or its ``PublishError`` as the HTTP answer it names."""
    try:
        return await work
    except PublishError as exc:
        raise HTTPException(exc.status, exc.body()) from None


# --------------------------------------------------------------------------------------------------
# publishing: into the local store, or forwarded to the store's host


class PolicyWriter(Protocol):
    """Where a gateway's ``/v1/policies`` routes publish (``policy_writer``); errors are
    ``PublishError``s."""

    async def declare(self, namespace: str, req: UploadRequest) -> UploadTicket: ...

    async def put(
        self, namespace: str, upload_id: str, path: str, offset: int, chunks: AsyncIterator[bytes]
    ) -> int: ...

    async def commit(self, namespace: str, upload_id: str) -> PolicyRef: ...

    async def register(self, namespace: str, req: RegisterRequest) -> PolicyRef: ...

    async def refs(self, namespace: str) -> list[PolicyRef]: ...


def policy_writer(settings: Settings) -> PolicyWriter:
    """The store this process publishes into: the local one, or the learner's over HTTP
    (``LOOM_POLICY_STORE_URL``, the service token)."""
    if settings.policy_store_url:
        return RemotePolicyWriter(settings.policy_store_url, settings.service_token)
    return LocalPolicyWriter.from_settings(settings)


def register_roots(settings: Settings) -> list[Path]:
    return [Path(r.strip()) for r in settings.gateway_policy_register_roots.split(",") if r.strip()]


class LocalPolicyWriter:
    def __init__(self, uploads: Uploads, roots: list[Path]) -> None:
        self.uploads, self.roots = uploads, roots

    @classmethod
    def from_settings(cls, settings: Settings) -> LocalPolicyWriter:
        store = PolicyStore(settings.policy_store_path)
        uploads = Uploads(
            store, max_bytes=settings.gateway_policy_max_bytes, ttl_s=settings.gateway_policy_upload_ttl_s
        )
        return cls(uploads, register_roots(settings))

    async def declare(self, namespace: str, req: UploadRequest) -> UploadTicket:
        return await asyncio.to_thread(self.uploads.declare, namespace, req)

    async def put(
        self, namespace: str, upload_id: str, path: str, offset: int, chunks: AsyncIterator[bytes]
    ) -> int:
        part = await asyncio.to_thread(self.uploads.part, namespace, upload_id, path, offset)
        try:
            async for chunk in chunks:
                part.write(chunk)  # an IntegrityError drops the file
        except BaseException:
            part.abort()  # a broken part: the file starts again from 0
            raise
        return await asyncio.to_thread(part.finish)

    async def commit(self, namespace: str, upload_id: str) -> PolicyRef:
        return await asyncio.to_thread(self.uploads.commit, namespace, upload_id)

    async def register(self, namespace: str, req: RegisterRequest) -> PolicyRef:
        return await asyncio.to_thread(self.uploads.register, namespace, req, self.roots)

    async def refs(self, namespace: str) -> list[PolicyRef]:
        if not is_namespace(namespace):
            return []
        return await asyncio.to_thread(self.uploads.store.namespace(namespace).refs)


class RemotePolicyWriter:
    """The internal publishing routes of the store's host (``add_publish_routes``)."""

    def __init__(self, url: str, token: str = "", timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.headers = service_headers(token)
        self.timeout = httpx.Timeout(timeout_s, connect=10.0)

    async def _call(self, method: str, route: str, **kw: Any) -> Any:
        url = self.url + route
        try:
            async with httpx.AsyncClient(timeout=self.timeout) as client:
                resp = await client.request(method, url, headers=self.headers, **kw)
        except httpx.HTTPError as exc:
            raise PublishUnavailable(f"the policy store did not answer ({type(exc).__name__})") from exc
        if resp.status_code >= 300:
            try:
                body = resp.json()
                detail = body.get("detail", "")
            except ValueError:
                body, detail = {}, ""
            kinds = {403: PublishForbidden, 404: PublishNotFound, 409: PublishConflict}
            if resp.status_code == 422 and body.get("error") == "integrity_error":
                raise IntegrityError(str(detail))
            if resp.status_code in kinds or resp.status_code == 422:
                raise kinds.get(resp.status_code, PublishError)(
                    detail if isinstance(detail, str) else json.dumps(detail)
                )
            raise PublishUnavailable(f"the policy store answered {resp.status_code}")
        return resp.json()

    async def declare(self, namespace: str, req: UploadRequest) -> UploadTicket:
        body = await self._call("POST", f"/v1/store/ns/{namespace}/uploads", json=req.model_dump(mode="json"))
        return UploadTicket.model_validate(body)

    async def put(
        self, namespace: str, upload_id: str, path: str, offset: int, chunks: AsyncIterator[bytes]
    ) -> int:
        route = f"/v1/store/ns/{namespace}/uploads/{upload_id}/files/{path}?offset={offset}"
        body = await self._call("PUT", route, content=chunks)
        return int(body["received"])

    async def commit(self, namespace: str, upload_id: str) -> PolicyRef:
        return PolicyRef.model_validate(
            await self._call("POST", f"/v1/store/ns/{namespace}/uploads/{upload_id}/commit")
        )

    async def register(self, namespace: str, req: RegisterRequest) -> PolicyRef:
        body = await self._call(
            "POST", f"/v1/store/ns/{namespace}/register", json=req.model_dump(mode="json")
        )
        return PolicyRef.model_validate(body)

    async def refs(self, namespace: str) -> list[PolicyRef]:
        return [
            PolicyRef.model_validate(r) for r in await self._call("GET", f"/v1/store/ns/{namespace}/refs")
        ]


class PublishUnavailable(PublishError):
    status, error = 503, "policy_store_unavailable"


# --------------------------------------------------------------------------------------------------
# client


class RemotePolicyStore:
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
        """``pull=False``: answer from the manifests alone (records keep the server's paths).
        ``namespace``: a trainer's versions (cached under ``<cache>/ns/<name>``)."""
        if namespace is not None and not is_namespace(namespace):
            raise ValueError(f"{namespace!r} is not a policy namespace name")
        self.url = url.rstrip("/")
        self.cache = Path(cache)
        self.name = namespace
        self.root = self.cache if namespace is None else self.cache / NAMESPACES / namespace
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
        return self.root / f"v{version}"

    def cached(self, version: int) -> PolicyVersion | None:
        meta = self.path_of(version) / "policy.json"
        return PolicyVersion.model_validate_json(meta.read_text()) if meta.exists() else None

    def latest(self) -> PolicyVersion | None:
        body = self._get_json(f"{self.prefix}/latest", time.monotonic() + self.timeout_s)
        return None if body is None else self.get(int(body["version"]))

    def serving(self, version: int) -> PolicyVersion | None:
        return serving_of(self, version)

    def get(self, version: int) -> PolicyVersion | None:
        if self.pull and (found := self.cached(version)) is not None:
            return found
        deadline = time.monotonic() + self.timeout_s
        manifest = self._get_json(f"{self.prefix}/v/{version}/manifest", deadline)
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
                record = record.model_copy(
                    update={"path": str(self.path_of(version)), "meta": local_meta(record)}
                )
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
        url = f"{self.url}{self.prefix}/v/{version}/files/{f['path']}"
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
