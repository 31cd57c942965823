"""Publishing policy versions through the gateway (``/v1/policies``, docs/interop-rollout.md): a real
gateway on loopback, real keys, a real checkpoint; the learner API serving the store where the
gateway forwards to it. Replicas pull what was published with ``RemotePolicyStore``."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

import httpx
import pytest

from loom.clients.base import LoomHTTPError
from loom.clients.policies import PolicyPublisher
from loom.store import PolicyHashMismatch, PolicyStore, RemotePolicyStore
from tests.interop_rollout.conftest import (
    JOBS_ONLY_KEY,
    LOOM_NAMED_KEY,
    OTHER_KEY,
    PUBLISHER_KEY,
    TOKEN,
    Server,
    gateway_settings,
    start_gateway,
    start_learner_api,
)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def declare(url: str, key: str, files: dict[str, bytes], version: int | None = None) -> httpx.Response:
    body = {
        "kind": "full",
        "version": version,
        "files": [
            {"path": p, "size": len(b), "sha256": hashlib.sha256(b).hexdigest()} for p, b in files.items()
        ],
    }
    return httpx.post(f"{url}/v1/policies/uploads", json=body, headers=auth(key))


def put(url: str, key: str, upload: str, path: str, data: bytes, offset: int = 0) -> httpx.Response:
    return httpx.put(
        f"{url}/v1/policies/uploads/{upload}/files/{path}",
        params={"offset": offset},
        content=data,
        headers=auth(key),
    )


def commit(url: str, key: str, upload: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/policies/uploads/{upload}/commit", headers=auth(key))


def test_a_checkpoint_published_in_parts_is_one_immutable_version_of_the_keys_namespace(
    gateway: tuple[Server, Any], checkpoint: Path
) -> None:
    server, settings = gateway
    publisher = PolicyPublisher(server.url, PUBLISHER_KEY, part_bytes=32_000)  # the weights: 3 parts
    ref = publisher.publish_dir(checkpoint, meta={"step": 1})
    assert (ref.namespace, ref.version, ref.kind) == ("alice", 1, "full")
    store = PolicyStore(settings.policy_store_path, create=False).namespace("alice")
    folder = store.path_of(1)
    for f in ref.files:  # the bytes the trainer had, listed in the manifest written at commit
        assert (folder / f["path"]).read_bytes() == (checkpoint / f["path"]).read_bytes()
        assert not os.stat(folder / f["path"]).st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)
    assert {f["path"] for f in ref.files} >= {"model.safetensors", "config.json", "tokenizer.json"}
    assert json.loads((folder / "manifest.json").read_text()) == ref.files
    record = store.get(1)
    assert record is not None and record.namespace == "alice" and record.meta == {"step": 1}
    assert PolicyStore(settings.policy_store_path, create=False).versions() == []  # not the learner's
    assert publisher.publish_dir(checkpoint).version == 2  # None: the namespace's next
    assert [r.version for r in publisher.versions()] == [1, 2] and publisher.version(1) == ref

    # a published version never changes: its number is taken, and so is any below the newest
    files = {"model.safetensors": b"other weights"}
    for version in (1, 2):
        r = declare(server.url, PUBLISHER_KEY, files, version=version)
        assert r.status_code == 409 and r.json()["error"] == "conflict", r.text
    assert declare(server.url, PUBLISHER_KEY, files, version=5).json()["version"] == 5


def weights_of(checkpoint: Path, flip: int | None = None) -> dict[str, bytes]:
    """A checkpoint's weights and config as upload files; ``flip``: one weight byte that many bytes
    from the end changed (another version of the same shapes)."""
    weights = bytearray((checkpoint / "model.safetensors").read_bytes())
    if flip is not None:
        weights[-flip] ^= 0x01
    return {"model.safetensors": bytes(weights), "config.json": (checkpoint / "config.json").read_bytes()}


def send_all(url: str, key: str, upload: str, files: dict[str, bytes]) -> None:
    for path, data in files.items():
        assert put(url, key, upload, path, data).status_code == 204


def test_two_uploads_of_one_version_the_second_commit_is_a_conflict(
    gateway: tuple[Server, Any], checkpoint: Path
) -> None:
    server, settings = gateway
    first = weights_of(checkpoint)
    second = weights_of(checkpoint, flip=7)
    a = declare(server.url, PUBLISHER_KEY, first).json()
    b = declare(server.url, PUBLISHER_KEY, second).json()
    assert a["version"] == b["version"] == 1
    for ticket, files in ((a, first), (b, second)):
        send_all(server.url, PUBLISHER_KEY, ticket["upload_id"], files)
    assert commit(server.url, PUBLISHER_KEY, a["upload_id"]).status_code == 201
    r = commit(server.url, PUBLISHER_KEY, b["upload_id"])
    assert r.status_code == 409, r.text
    folder = PolicyStore(settings.policy_store_path, create=False).namespace("alice").path_of(1)
    assert (folder / "model.safetensors").read_bytes() == first["model.safetensors"]


def test_a_tampered_or_truncated_upload_is_refused_and_the_previous_version_stays(
    gateway: tuple[Server, Any], checkpoint: Path
) -> None:
    server, settings = gateway
    PolicyPublisher(server.url, PUBLISHER_KEY).publish_dir(checkpoint)
    weights = (checkpoint / "model.safetensors").read_bytes()
    config = (checkpoint / "config.json").read_bytes()
    files = {"model.safetensors": weights, "config.json": config}
    ticket = declare(server.url, PUBLISHER_KEY, files).json()
    upload = ticket["upload_id"]
    tampered = bytearray(weights)
    tampered[1000] ^= 0xFF  # same size, one byte changed
    r = put(server.url, PUBLISHER_KEY, upload, "model.safetensors", bytes(tampered))
    assert r.status_code == 422 and r.json()["error"] == "integrity_error", r.text
    assert "model.safetensors" in r.json()["detail"]
    r = put(server.url, PUBLISHER_KEY, upload, "config.json", config + b"  ")  # past the declared size
    assert r.status_code == 422 and r.json()["error"] == "integrity_error"
    assert put(server.url, PUBLISHER_KEY, upload, "config.json", config).status_code == 204
    half = len(weights) // 2  # truncated: the first part arrives, the rest never does
    assert put(server.url, PUBLISHER_KEY, upload, "model.safetensors", weights[:half]).status_code == 204
    r = put(server.url, PUBLISHER_KEY, upload, "model.safetensors", weights[half:], offset=half + 1)
    assert r.status_code == 409, r.text  # a part at the wrong offset
    r = commit(server.url, PUBLISHER_KEY, upload)
    assert r.status_code == 422 and "model.safetensors" in r.json()["detail"], r.text
    store = PolicyStore(settings.policy_store_path, create=False).namespace("alice")
    assert store.versions() == [1] and store.latest() is not None and store.latest().version == 1  # type: ignore[union-attr]
    assert not list(store.root.glob(".tmp-*"))
    # the rest arrives: now it commits, as version 2
    assert (
        put(server.url, PUBLISHER_KEY, upload, "model.safetensors", weights[half:], offset=half).status_code
        == 204
    )
    assert commit(server.url, PUBLISHER_KEY, upload).json()["version"] == 2


def test_declarations_outside_the_contract_are_422(gateway: tuple[Server, Any]) -> None:
    server, _ = gateway
    for path in ("../x.json", "/etc/x.json", "a/../../x.json", ".hidden.json", "run.sh", "policy.json"):
        r = declare(server.url, PUBLISHER_KEY, {path: b"x"})
        assert r.status_code == 422, (path, r.text)
    r = declare(server.url, PUBLISHER_KEY, {"model.safetensors": b"x" * 2_000_001})  # over the bound
    assert r.status_code == 422 and "LOOM_GATEWAY_POLICY_MAX_BYTES" in r.json()["detail"]


def test_a_key_without_the_policy_scope_is_forbidden(gateway: tuple[Server, Any]) -> None:
    server, _ = gateway
    assert declare(server.url, JOBS_ONLY_KEY, {"model.safetensors": b"x"}).status_code == 403
    assert httpx.get(f"{server.url}/v1/policies", headers=auth(JOBS_ONLY_KEY)).status_code == 403
    with pytest.raises(LoomHTTPError) as info:
        PolicyPublisher(server.url, JOBS_ONLY_KEY).versions()
    assert info.value.status == 403


def test_another_keys_versions_and_uploads_are_invisible(
    gateway: tuple[Server, Any], checkpoint: Path
) -> None:
    server, _ = gateway
    files = weights_of(checkpoint)
    ticket = declare(server.url, PUBLISHER_KEY, files).json()
    upload = ticket["upload_id"]
    # bob cannot send to, or commit, alice's upload: it does not exist for him
    assert put(server.url, OTHER_KEY, upload, "config.json", files["config.json"]).status_code == 404
    assert commit(server.url, OTHER_KEY, upload).status_code == 404
    send_all(server.url, PUBLISHER_KEY, upload, files)
    assert commit(server.url, PUBLISHER_KEY, upload).status_code == 201
    mine = httpx.get(f"{server.url}/v1/policies/1", headers=auth(PUBLISHER_KEY))
    theirs = httpx.get(f"{server.url}/v1/policies/1", headers=auth(OTHER_KEY))
    missing = httpx.get(f"{server.url}/v1/policies/9", headers=auth(OTHER_KEY))
    assert mine.status_code == 200 and theirs.status_code == 404
    assert theirs.json() == {**missing.json(), "detail": missing.json()["detail"].replace("9", "1")}
    assert httpx.get(f"{server.url}/v1/policies", headers=auth(OTHER_KEY)).json() == []
    # a job naming alice's namespace is answered as one naming a version that does not exist
    job = {"job_key": "j", "prompts": ["1 + 1 = ?"], "policy_version": 1}
    r = httpx.post(
        f"{server.url}/v1/jobs", json={**job, "policy_namespace": "alice"}, headers=auth(OTHER_KEY)
    )
    r_missing = httpx.post(
        f"{server.url}/v1/jobs", json={**job, "policy_namespace": "bob"}, headers=auth(OTHER_KEY)
    )
    assert r.status_code == r_missing.status_code == 422 and r.json() == r_missing.json(), r.text
    r = httpx.post(
        f"{server.url}/v1/jobs", json={**job, "policy_namespace": "alice"}, headers=auth(PUBLISHER_KEY)
    )
    assert r.status_code == 201, r.text
    r = httpx.post(
        f"{server.url}/v1/jobs",
        json={
            **job,
            "job_key": "k",
            "policy_namespace": "alice",
            "policy_version": 2,
            "policy_match": "exact",
        },
        headers=auth(PUBLISHER_KEY),
    )
    assert r.status_code == 422 and "the newest is 1" in r.text


def test_registering_a_path_needs_an_operator_root(
    tmp_path: Path, checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    shared = tmp_path / "shared"
    shutil.copytree(checkpoint, shared / "ckpt")
    (tmp_path / "elsewhere").mkdir()
    off = gateway_settings(tmp_path / "off")
    with start_gateway(off) as server:
        r = httpx.post(
            f"{server.url}/v1/policies/register",
            json={"path": str(shared / "ckpt")},
            headers=auth(PUBLISHER_KEY),
        )
        assert r.status_code == 403 and "LOOM_GATEWAY_POLICY_REGISTER_ROOTS" in r.json()["detail"]
    monkeypatch.setenv("LOOM_GATEWAY_POLICY_REGISTER_ROOTS", str(shared))
    on = gateway_settings(tmp_path / "on")
    (shared / "link").symlink_to(shared / "ckpt")
    (shared / "linked").mkdir()
    (shared / "linked" / "model.safetensors").symlink_to(tmp_path / "elsewhere" / "x")
    with start_gateway(on) as server:

        def register(path: Path) -> httpx.Response:
            return httpx.post(
                f"{server.url}/v1/policies/register", json={"path": str(path)}, headers=auth(PUBLISHER_KEY)
            )

        assert register(tmp_path / "elsewhere").status_code == 403
        assert register(shared / "ckpt" / ".." / ".." / "elsewhere").status_code == 422
        assert register(shared / "link").status_code == 422  # reached through a link
        assert register(shared / "linked").status_code == 422  # holds a link
        r = register(shared / "ckpt")
        assert r.status_code == 201 and r.json()["registered"] and r.json()["version"] == 1, r.text
        record = PolicyStore(on.policy_store_path, create=False).namespace("alice").get(1)
        assert record is not None and record.path == str(shared / "ckpt")
        weights = next(f for f in r.json()["files"] if f["path"] == "model.safetensors")
        assert (
            weights["sha256"] == hashlib.sha256((checkpoint / "model.safetensors").read_bytes()).hexdigest()
        )


def test_uploads_forwarded_to_the_learners_store_are_pulled_by_a_replica_on_another_host(
    tmp_path: Path, checkpoint: Path
) -> None:
    """The gateway holds no store (LOOM_POLICY_STORE_URL): it checks the key and forwards each part
    to the learner API, whose store the replica pulls the version from, every file's sha256 checked."""
    learner = gateway_settings(tmp_path / "learner")
    with start_learner_api(learner) as store_host:
        gw = gateway_settings(tmp_path / "gw", policy_store_url=store_host.url)
        with start_gateway(gw) as server:
            ref = PolicyPublisher(server.url, PUBLISHER_KEY, part_bytes=40_000).publish_dir(checkpoint)
            assert PolicyPublisher(server.url, PUBLISHER_KEY).versions() == [ref]
            assert PolicyPublisher(server.url, OTHER_KEY).versions() == []
            r = declare(server.url, PUBLISHER_KEY, {"model.safetensors": b"x"}, version=1)
            assert r.status_code == 409, r.text
            # the store's host checks what is forwarded against its own base model, aborts, deletes
            files = weights_of(checkpoint)
            cfg = json.loads(files["config.json"])
            files["config.json"] = json.dumps({**cfg, "num_hidden_layers": 64}).encode()
            upload = declare(server.url, PUBLISHER_KEY, files).json()["upload_id"]
            send_all(server.url, PUBLISHER_KEY, upload, files)
            r = commit(server.url, PUBLISHER_KEY, upload)
            assert r.status_code == 422 and r.json()["error"] == "invalid_checkpoint", r.text
            assert "num_hidden_layers 64" in r.json()["detail"]
            upload = declare(server.url, PUBLISHER_KEY, weights_of(checkpoint)).json()["upload_id"]
            route = f"{server.url}/v1/policies/uploads/{upload}"
            assert httpx.delete(route, headers=auth(PUBLISHER_KEY)).status_code == 204
            assert httpx.delete(route, headers=auth(PUBLISHER_KEY)).status_code == 404
            assert PolicyPublisher(server.url, PUBLISHER_KEY).publish_dir(checkpoint).version == 2
            assert httpx.delete(f"{server.url}/v1/policies/2", headers=auth(PUBLISHER_KEY)).status_code == 204
        assert not (tmp_path / "gw" / "policy").exists()  # nothing written on the gateway's host
        store = PolicyStore(learner.policy_store_path, create=False).namespace("alice")
        assert store.versions() == [1]
        replica = RemotePolicyStore(store_host.url, tmp_path / "replica", token=TOKEN).namespace("alice")
        got = replica.get(1)
        assert (
            got is not None
            and got.namespace == "alice"
            and got.path == str(tmp_path / "replica" / "ns" / "alice" / "v1")
        )
        for f in ref.files:
            assert (Path(got.path) / f["path"]).read_bytes() == (checkpoint / f["path"]).read_bytes()
        assert RemotePolicyStore(store_host.url, tmp_path / "r2", token=TOKEN).namespace("bob").get(1) is None
        assert (
            RemotePolicyStore(store_host.url, tmp_path / "r3", token=TOKEN).get(1) is None
        )  # not the learner's


# --------------------------------------------------------------------------------------------------
# issue 35 finding 8: what the store serves is what was published


def write_checkpoint(d: Path) -> None:
    (d / "model.safetensors").write_bytes(b"w" * 50_000)
    (d / "sub").mkdir()
    (d / "sub" / "vocab.json").write_text('{"a": 1}')


@pytest.fixture
def served(tmp_path: Path) -> Any:
    settings = gateway_settings(tmp_path / "learner")
    store = PolicyStore(settings.policy_store_path)
    store.publish(1, write_checkpoint)
    with start_learner_api(settings) as server:
        yield store, server


def test_the_manifest_is_written_at_publish_so_a_file_changed_before_its_first_request_is_refused(
    served: Any, tmp_path: Path
) -> None:
    store, server = served
    assert (store.path_of(1) / "manifest.json").is_file()  # before any request
    weights = store.path_of(1) / "model.safetensors"
    weights.chmod(0o644)
    weights.write_bytes(b"x" * 50_000)  # changed before anyone asked for the version
    with pytest.raises(PolicyHashMismatch, match="model.safetensors"):
        RemotePolicyStore(server.url, tmp_path / "cache", token=TOKEN).get(1)
    assert not (tmp_path / "cache" / "v1").exists()


def test_a_version_without_a_manifest_is_not_served(served: Any, tmp_path: Path) -> None:
    store, server = served
    (store.path_of(1) / "manifest.json").unlink()
    assert RemotePolicyStore(server.url, tmp_path / "cache", token=TOKEN).get(1) is None


def test_a_file_swapped_for_a_symlink_after_publish_is_not_served(served: Any, tmp_path: Path) -> None:
    store, server = served
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"w" * 50_000)  # even the same bytes: a link is never followed
    weights = store.path_of(1) / "model.safetensors"
    weights.unlink()
    weights.symlink_to(secret)
    url = f"{server.url}/v1/store/v/1/files/model.safetensors"
    r = httpx.get(url, headers=auth(TOKEN))
    assert r.status_code == 404, r.status_code
    assert (
        httpx.get(f"{server.url}/v1/store/v/1/files/sub/vocab.json", headers=auth(TOKEN)).status_code == 200
    )


def test_a_symlinked_folder_in_a_served_path_is_refused(served: Any, tmp_path: Path) -> None:
    store, server = served
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "vocab.json").write_text('{"a": 1}')  # the same bytes as the published file
    sub = store.path_of(1) / "sub"
    for f in sub.iterdir():
        f.chmod(0o644)
    import shutil

    shutil.rmtree(sub)
    sub.symlink_to(outside, target_is_directory=True)
    r = httpx.get(f"{server.url}/v1/store/v/1/files/sub/vocab.json", headers=auth(TOKEN))
    assert r.status_code == 404
    # and a version folder that is itself a link
    store.path_of(2).symlink_to(store.path_of(1), target_is_directory=True)
    (store.root / "LATEST").write_text("1")
    r = httpx.get(f"{server.url}/v1/store/v/2/files/model.safetensors", headers=auth(TOKEN))
    assert r.status_code == 404


def test_a_registered_version_is_pulled_over_http_and_a_changed_file_refused(
    tmp_path: Path, checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    shared = tmp_path / "shared"
    shutil.copytree(checkpoint, shared / "ckpt")
    monkeypatch.setenv("LOOM_GATEWAY_POLICY_REGISTER_ROOTS", str(shared))  # read by the store's host
    learner = gateway_settings(tmp_path / "learner")
    with start_learner_api(learner) as store_host:
        gw = gateway_settings(tmp_path / "gw", policy_store_url=store_host.url)
        with start_gateway(gw) as server:
            r = httpx.post(
                f"{server.url}/v1/policies/register",
                json={"path": str(shared / "ckpt")},
                headers=auth(PUBLISHER_KEY),
            )
            assert r.status_code == 201 and r.json()["registered"], r.text
        replica = RemotePolicyStore(store_host.url, tmp_path / "replica", token=TOKEN).namespace("alice")
        got = replica.get(1)
        assert got is not None and got.path == str(tmp_path / "replica" / "ns" / "alice" / "v1")
        assert (Path(got.path) / "model.safetensors").read_bytes() == (
            checkpoint / "model.safetensors"
        ).read_bytes()
        (shared / "ckpt" / "tokenizer.json").write_text("{}")  # the trainer changed its folder
        later = RemotePolicyStore(store_host.url, tmp_path / "replica2", token=TOKEN).namespace("alice")
        with pytest.raises(PolicyHashMismatch, match="tokenizer.json"):
            later.get(1)


def test_abandoned_uploads_expire_and_a_namespace_holds_few_open(tmp_path: Path) -> None:
    from loom.contracts.policies import UploadRequest
    from loom.store import PublishConflict, PublishNotFound
    from loom.store.uploads import Uploads

    store = PolicyStore(tmp_path / "policy")
    body = UploadRequest.model_validate(
        {"files": [{"path": "model.safetensors", "size": 1, "sha256": hashlib.sha256(b"x").hexdigest()}]}
    )
    gone = Uploads(store, max_bytes=100, ttl_s=1e-9)  # every upload has expired by its next request
    ticket = gone.declare("alice", body)
    with pytest.raises(PublishNotFound, match="expired"):
        gone.part("alice", ticket.upload_id, "model.safetensors", 0)
    assert not (gone.dir / ticket.upload_id).exists()
    uploads = Uploads(store, max_bytes=100, ttl_s=3600)
    for _ in range(4):
        uploads.declare("alice", body)
    with pytest.raises(PublishConflict, match="4 uploads"):
        uploads.declare("alice", body)
    uploads.declare("bob", body)  # another namespace has its own


def test_a_job_naming_a_namespace_or_exact_needs_a_version(gateway: tuple[Server, Any]) -> None:
    server, _ = gateway
    job = {"job_key": "j", "prompts": ["1 + 1 = ?"]}
    for extra in ({"policy_namespace": "alice"}, {"policy_match": "exact"}):
        r = httpx.post(f"{server.url}/v1/jobs", json={**job, **extra}, headers=auth(PUBLISHER_KEY))
        assert r.status_code == 422 and "need a policy_version" in r.text, r.text


def test_a_key_named_like_the_learners_namespace_cannot_publish(gateway: tuple[Server, Any]) -> None:
    server, _ = gateway
    r = declare(server.url, LOOM_NAMED_KEY, {"model.safetensors": b"x"})
    assert r.status_code == 403 and "not 'loom'" in r.json()["detail"], r.text
    assert httpx.get(f"{server.url}/v1/policies", headers=auth(LOOM_NAMED_KEY)).json() == []


def test_a_key_deletes_its_versions_unless_its_work_names_them_and_aborts_its_uploads(
    gateway: tuple[Server, Any], checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over HTTP: a version named by a queued job of the key is a 409 to delete, another key's is a
    404 as a missing one, an upload is aborted with ``DELETE``, and a namespace over its quota is a 413."""
    server, settings = gateway
    publisher = PolicyPublisher(server.url, PUBLISHER_KEY)
    assert [publisher.publish_dir(checkpoint).version for _ in range(2)] == [1, 2]
    job = {"job_key": "pinned", "prompts": ["1 + 1 = ?"], "policy_version": 1, "policy_namespace": "alice"}
    assert httpx.post(f"{server.url}/v1/jobs", json=job, headers=auth(PUBLISHER_KEY)).status_code == 201
    r = httpx.delete(f"{server.url}/v1/policies/1", headers=auth(PUBLISHER_KEY))
    assert r.status_code == 409 and "queued or running" in r.json()["detail"], r.text
    assert httpx.delete(f"{server.url}/v1/policies/2", headers=auth(OTHER_KEY)).status_code == 404
    assert httpx.delete(f"{server.url}/v1/policies/2", headers=auth(PUBLISHER_KEY)).status_code == 204
    assert [r.version for r in publisher.versions()] == [1]

    ticket = declare(server.url, PUBLISHER_KEY, weights_of(checkpoint)).json()
    assert ticket["version"] == 3  # 2 is never given again
    route = f"{server.url}/v1/policies/uploads/{ticket['upload_id']}"
    assert httpx.delete(route, headers=auth(OTHER_KEY)).status_code == 404
    assert httpx.delete(route, headers=auth(PUBLISHER_KEY)).status_code == 204
    assert commit(server.url, PUBLISHER_KEY, ticket["upload_id"]).status_code == 404

    size = sum(f["size"] for f in publisher.version(1).files)  # every file of the one version left
    monkeypatch.setenv("LOOM_GATEWAY_POLICY_QUOTA_BYTES", str(size + 1000))
    r = declare(server.url, PUBLISHER_KEY, weights_of(checkpoint))
    assert r.status_code == 413 and r.json()["error"] == "quota_exceeded", r.text
    assert (r.json()["quota"], r.json()["in_use"]) == ("policy_bytes", size)


def test_a_part_cut_off_by_its_sender_is_dropped_without_an_unhandled_error(
    gateway: tuple[Server, Any], checkpoint: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A PUT whose client went away mid-body logged an unhandled-error traceback."""
    import socket
    import time
    from urllib.parse import urlsplit

    server, _ = gateway
    files = weights_of(checkpoint)
    upload = declare(server.url, PUBLISHER_KEY, files).json()["upload_id"]
    where = urlsplit(server.url)
    with socket.create_connection((where.hostname, where.port)) as conn:
        conn.sendall(
            (
                f"PUT /v1/policies/uploads/{upload}/files/model.safetensors HTTP/1.1\r\nHost: x\r\n"
                f"Authorization: Bearer {PUBLISHER_KEY}\r\n"
                f"Content-Length: {len(files['model.safetensors'])}\r\n\r\n"
            ).encode()
            + files["model.safetensors"][:1000]
        )
        time.sleep(0.5)
    time.sleep(1.0)
    assert not [r for r in caplog.records if r.exc_info], [
        r.getMessage() for r in caplog.records if r.exc_info
    ]
    r = put(server.url, PUBLISHER_KEY, upload, "model.safetensors", files["model.safetensors"])
    assert r.status_code == 204, r.text  # the cut-off part was dropped: the file starts again from 0
