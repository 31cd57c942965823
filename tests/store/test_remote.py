"""loom.store.remote: the learner API serves the policy store over HTTP (a real uvicorn server on
loopback); replicas pull versions into their own cache, checking every file's sha256."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from learner.api import build_app
from loom.contracts.settings import Settings
from loom.queue import make_celery
from loom.store import (
    PolicyHashMismatch,
    PolicyManifestInvalid,
    PolicyPullTimeout,
    PolicyStore,
    PolicyStoreUnreachable,
    RemotePolicyStore,
    open_policy_store,
)
from loom.store.manifest import checked_files
from tests.conftest import free_port


def write_checkpoint(seed: int) -> Any:
    def write(d: Path) -> None:
        (d / "model.safetensors").write_bytes(bytes([seed]) * 300_000)
        (d / "tokenizer").mkdir()
        (d / "tokenizer" / "vocab.json").write_text(f'{{"seed": {seed}}}')

    return write


class StoreServer:
    def __init__(self, settings: Settings) -> None:
        self.file_requests: list[str] = []
        app = build_app(settings, make_celery("learner", settings))

        @app.middleware("http")
        async def count(request: Any, call_next: Any) -> Any:
            if "/files/" in request.url.path:
                self.file_requests.append(request.url.path)
            return await call_next(request)

        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> StoreServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "store server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[PolicyStore, StoreServer]]:
    store = PolicyStore(tmp_path / "learner" / "policy")
    store.publish(1, write_checkpoint(1))
    store.publish(2, write_checkpoint(2))
    settings = Settings(data_dir=tmp_path / "learner", service_token="s3cret")
    with StoreServer(settings) as server:
        yield store, server


def test_a_pulled_version_is_the_learners_files_in_the_replicas_own_cache(
    served: Any, tmp_path: Path
) -> None:
    store, server = served
    cache = tmp_path / "replica" / "cache"
    remote = RemotePolicyStore(server.url, cache, token="s3cret")
    killed = cache / ".tmp-v1-999-dead"  # what a pull killed mid-way leaves
    killed.mkdir()
    (killed / "model.safetensors").write_bytes(b"half")
    assert (store.path_of(1) / "manifest.json").exists()  # hashed at publish
    got = remote.get(1)
    assert got is not None and got.version == 1 and got.path == str(cache / "v1")
    for rel in ("model.safetensors", "tokenizer/vocab.json"):
        assert (cache / "v1" / rel).read_bytes() == (store.path_of(1) / rel).read_bytes()
    assert not list(cache.glob(".tmp-*"))
    asked = len(server.file_requests)
    assert remote.get(1) == got and len(server.file_requests) == asked  # cached: not pulled again
    latest = remote.latest()
    assert latest is not None and latest.version == 2 and (cache / "v2" / "model.safetensors").exists()
    assert remote.get(7) is None


def test_serving_after_prune_pulls_the_newest_version_above(served: Any, tmp_path: Path) -> None:
    store, server = served
    store.publish(3, write_checkpoint(3))
    store.prune(keep=1)
    remote = RemotePolicyStore(server.url, tmp_path / "cache", token="s3cret")
    found = [remote.serving(v) for v in (1, 3, 4)]
    assert [f.version if f else None for f in found] == [3, 3, None]


def test_a_file_that_is_not_the_manifests_is_refused_and_nothing_is_cached(
    served: Any, tmp_path: Path
) -> None:
    store, server = served
    assert store.manifest(2) is not None  # hashed at publish, then the disk changes
    weights = store.path_of(2) / "model.safetensors"
    weights.chmod(0o644)  # published files are read-only: this is someone with the store's rights
    weights.write_bytes(b"\x00" * 300_000)  # same size, other bytes
    remote = RemotePolicyStore(server.url, tmp_path / "cache", token="s3cret")
    with pytest.raises(PolicyHashMismatch, match="model.safetensors"):
        remote.get(2)
    assert not (tmp_path / "cache" / "v2").exists() and not list((tmp_path / "cache").glob(".tmp-*"))


def test_the_store_routes_need_the_service_token_and_serve_only_listed_files(
    served: Any, tmp_path: Path
) -> None:
    import httpx

    _, server = served
    with pytest.raises(PolicyStoreUnreachable, match="401"):
        RemotePolicyStore(server.url, tmp_path / "cache").get(1)
    auth = {"Authorization": "Bearer s3cret"}
    for rel in ("manifest.json", "../LATEST", "%2e%2e/LATEST", "tokenizer"):
        r = httpx.get(f"{server.url}/v1/store/v/1/files/{rel}", headers=auth)
        assert r.status_code == 404, rel


def test_two_workers_pulling_one_version_download_it_once(served: Any, tmp_path: Path) -> None:
    _, server = served
    cache = tmp_path / "cache"
    results: list[Any] = []
    workers = [
        threading.Thread(
            target=lambda: results.append(RemotePolicyStore(server.url, cache, token="s3cret").get(2))
        )
        for _ in range(4)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert len(results) == 4 and all(r is not None and r.version == 2 for r in results)
    files = [p for p in server.file_requests if "/v/2/" in p]
    assert sorted(files) == sorted(set(files)) and len(files) == 2  # model, vocab: once each


def test_a_store_that_does_not_answer_is_a_typed_error(tmp_path: Path) -> None:
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)  # accepts connections, never answers
    try:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(PolicyPullTimeout):
            RemotePolicyStore(url, tmp_path / "cache", timeout_s=0.5).get(1)
    finally:
        silent.close()
    with pytest.raises(PolicyStoreUnreachable):
        RemotePolicyStore(f"http://127.0.0.1:{free_port()}", tmp_path / "cache").get(1)


@pytest.mark.parametrize("path", ["../x", "/etc/passwd", "a/../../x", ".hidden", ""])
def test_a_manifest_naming_a_path_outside_its_version_is_refused(path: str) -> None:
    manifest = {"policy": {"version": 1, "path": "/x"}, "files": [{"path": path, "size": 1, "sha256": "0"}]}
    with pytest.raises(PolicyManifestInvalid):
        checked_files(manifest)


def test_the_gateway_check_reads_remote_manifests_and_pulls_nothing(served: Any, tmp_path: Path) -> None:
    from fastapi import HTTPException

    from gateway.validate import policy_version_problem

    _, server = served
    settings = Settings(data_dir=tmp_path / "gw", policy_store_url=server.url, service_token="s3cret")
    assert policy_version_problem(2, "policy_version", settings) is None
    problem = policy_version_problem(5, "policy_version", settings)
    assert problem is not None and "the newest is 2" in problem["detail"][0]["msg"]
    assert not (tmp_path / "gw").exists()  # no cache made, nothing pulled
    down = Settings(data_dir=tmp_path / "gw", policy_store_url=f"http://127.0.0.1:{free_port()}")
    with pytest.raises(HTTPException) as info:
        policy_version_problem(2, "policy_version", down)
    assert info.value.status_code == 503


def test_settings_choose_the_store(tmp_path: Path) -> None:
    local = open_policy_store(Settings(data_dir=tmp_path))
    assert isinstance(local, PolicyStore) and local.root == tmp_path / "policy"
    remote = open_policy_store(Settings(data_dir=tmp_path, policy_store_url="http://learner:8400"))
    assert isinstance(remote, RemotePolicyStore) and remote.root == tmp_path / "policy-cache"
    with pytest.raises(ValueError):
        Settings(policy_store_url="learner:8400")


def test_find_and_loadable_name_the_namespace_and_pull_into_its_cache_folder(
    served: Any, tmp_path: Path
) -> None:
    store, server = served
    store.namespace("alice").publish(2, write_checkpoint(7))
    cache = tmp_path / "cache"
    remote = RemotePolicyStore(server.url, cache, token="s3cret")
    mine = remote.loadable("alice", 1)  # alice has no 1: her newest above it
    assert mine is not None and (mine.namespace, mine.version) == ("alice", 2)
    assert mine.path == str(cache / "ns" / "alice" / "v2")
    assert (cache / "ns" / "alice" / "v2" / "model.safetensors").read_bytes() == bytes([7]) * 300_000
    assert remote.namespace("alice").find(None, 1, "exact") == remote.get(1)  # the learner's, by name
    assert remote.find("alice", 1, "exact") is None and not (cache / "v2").exists()
    reader = RemotePolicyStore(server.url, tmp_path / "gateway", token="s3cret", pull=False)
    found = reader.find("alice", 2, "exact")  # a manifest's record: the server's path, nothing pulled
    assert found is not None and found.path == str(store.namespace("alice").path_of(2))
    with pytest.raises(ValueError):
        reader.loadable("alice", 2)
    assert not (tmp_path / "gateway").exists()
