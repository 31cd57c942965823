"""Publishing checked before anything is allocated, register's walls, the namespace quota and the
upload slots (docs/security.md, "Publishing policy versions"): a real store on disk, real
checkpoints (tests/rollout's small Llama), the uploads' own code."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path

import pytest

from loom.contracts.policies import RegisterRequest, UploadRequest
from loom.store import PolicyStore, PublishConflict, PublishError, PublishForbidden
from loom.store.checks import Bounds, CheckpointRefused
from loom.store.errors import QuotaExceeded
from loom.store.uploads import Uploads
from tests.rollout.conftest import build_model_dir

WEIGHT_FILES = ("model.safetensors", "config.json")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("base") / "model", seed=0)


def uploads(tmp: Path, base: Path, **kw: object) -> Uploads:
    bounds = Bounds.of(base, factor=4.0)
    return Uploads(PolicyStore(tmp / "data" / "policy"), max_bytes=10**9, ttl_s=3600, bounds=bounds, **kw)  # type: ignore[arg-type]


def publish(up: Uploads, folder: Path, namespace: str = "alice", version: int | None = None) -> int:
    """Declare, send and commit ``folder``'s weight files as a version of ``namespace``."""
    ticket = declare(up, folder, namespace, version)
    send(up, folder, namespace, ticket.upload_id)
    return up.commit(namespace, ticket.upload_id).version


def declare(up: Uploads, folder: Path, namespace: str = "alice", version: int | None = None):  # type: ignore[no-untyped-def]
    files = [
        {
            "path": p,
            "size": (folder / p).stat().st_size,
            "sha256": hashlib.sha256((folder / p).read_bytes()).hexdigest(),
        }
        for p in WEIGHT_FILES
    ]
    return up.declare(namespace, UploadRequest(kind="full", version=version, files=files))  # type: ignore[arg-type]


def send(up: Uploads, folder: Path, namespace: str, upload_id: str) -> None:
    for p in WEIGHT_FILES:
        part = up.part(namespace, upload_id, p, 0)
        part.write((folder / p).read_bytes())
        part.finish()


def inflated(base: Path, tmp: Path) -> Path:
    """The base's weights (a few hundred KB) under a config that declares a 666 M-parameter model:
    transformers would allocate every declared tensor and fill the missing ones at random."""
    folder = tmp / "inflated"
    shutil.copytree(base, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(hidden_size=4096, intermediate_size=11008, num_hidden_layers=3, num_attention_heads=32)
    cfg.update(num_key_value_heads=32)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_a_config_declaring_a_model_far_larger_than_the_base_is_refused_before_it_is_sealed(
    tmp_path: Path, base: Path
) -> None:
    """A 25 KB upload made the engine allocate a 666 M-parameter model (its RSS 0.4 -> 2.4 GB): only
    file sizes were bounded. Now the config's sizes are bounded by a multiple of the base's."""
    up = uploads(tmp_path, base)
    with pytest.raises(CheckpointRefused, match="hidden_size 4096 is over 4 x the base model's 32"):
        publish(up, inflated(base, tmp_path))
    assert PolicyStore(tmp_path / "data" / "policy").namespace("alice").versions() == []
    assert publish(up, base) == 1  # the base's own shape is fine
    assert not list(
        (tmp_path / "data" / "policy" / ".uploads").glob("*/upload.json")
    )  # the refused one's slot is free


def test_weights_must_be_exactly_the_tensors_the_config_declares(tmp_path: Path, base: Path) -> None:
    """Sizes within the bound but weights that do not match the config (a layer more, a tensor of
    another shape, a malformed header) are refused from the safetensors header, nothing loaded."""
    up = uploads(tmp_path, base)
    deeper = tmp_path / "deeper"
    shutil.copytree(base, deeper)
    cfg = json.loads((deeper / "config.json").read_text())
    (deeper / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(CheckpointRefused, match="the weights lack .* tensors config.json declares"):
        publish(up, deeper)

    wider = tmp_path / "wider"
    shutil.copytree(base, wider)
    (wider / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    with pytest.raises(CheckpointRefused, match="has shape .* config.json declares"):
        publish(up, wider)

    broken = tmp_path / "broken"
    shutil.copytree(base, broken)
    raw = (base / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(struct.pack("<Q", 10**12) + raw[8:])  # SafetensorError before
    with pytest.raises(CheckpointRefused, match="header is larger than the file"):
        publish(up, broken)

    other = tmp_path / "other"
    shutil.copytree(base, other)
    (other / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen2"}))
    with pytest.raises(CheckpointRefused, match="model_type 'qwen2' is not the deployment's"):
        publish(up, other)


def test_register_never_takes_the_store_or_the_data_dir_and_keeps_the_uploads_allow_list(
    tmp_path: Path, base: Path
) -> None:
    """With the store under a register root, a key registered another key's version folder (and so
    served it as its own), and registering the store root listed every namespace's files and hashes;
    `.bin` and `.py` files were accepted."""
    data = tmp_path / "data"
    up = uploads(tmp_path, base, private=(data,))
    publish(up, base, namespace="bob")
    bobs = data / "policy" / "ns" / "bob" / "v1"
    assert bobs.is_dir()
    for path in (bobs, data / "policy", data, data / "policy" / "ns"):
        with pytest.raises(PublishForbidden, match="Loom's own data"):
            up.register("alice", RegisterRequest(path=str(path)), [tmp_path])
    mine = tmp_path / "shared" / "step-1"
    shutil.copytree(base, mine)
    for extra in ("pytorch_model.bin", "loader.py"):
        (mine / extra).write_bytes(b"x")
        with pytest.raises(PublishError, match="only .safetensors"):
            up.register("alice", RegisterRequest(path=str(mine)), [tmp_path / "shared"])
        (mine / extra).unlink()
    assert up.register("alice", RegisterRequest(path=str(mine)), [tmp_path / "shared"]).registered


def test_a_namespace_holds_at_most_its_quota_and_deleting_a_version_frees_it(
    tmp_path: Path, base: Path
) -> None:
    """25 versions of 15 MiB went in within 5 s, with no bound per key."""
    size = sum((base / p).stat().st_size for p in WEIGHT_FILES)
    up = uploads(tmp_path, base, quota_bytes=2 * size + size // 2)
    assert publish(up, base) == 1 and publish(up, base) == 2
    with pytest.raises(QuotaExceeded) as info:
        declare(up, base)
    assert info.value.status == 413 and info.value.body()["quota"] == "policy_bytes"
    assert info.value.body()["in_use"] == 2 * size
    with pytest.raises(PublishConflict, match="queued or running work"):
        up.delete("alice", 2, pinned={2})
    up.delete("alice", 2, pinned={1})
    assert publish(up, base) == 3  # a deleted number is never given again
    store = PolicyStore(tmp_path / "data" / "policy").namespace("alice")
    assert store.versions() == [1, 3] and store.latest().version == 3  # type: ignore[union-attr]


def test_an_upload_that_lost_its_version_race_frees_its_slot_and_an_upload_can_be_aborted(
    tmp_path: Path, base: Path
) -> None:
    """An upload that lost a version race could never commit but held one of the namespace's 4 open
    slots for an hour, with no abort: two races locked a key out."""
    up = uploads(tmp_path, base)
    tickets = [declare(up, base) for _ in range(4)]
    assert {t.version for t in tickets} == {1}
    with pytest.raises(PublishConflict, match="uploads of this namespace are open"):
        declare(up, base)
    for t in tickets:
        send(up, base, "alice", t.upload_id)
    assert up.commit("alice", tickets[0].upload_id).version == 1
    for t in tickets[1:]:
        with pytest.raises(PublishConflict, match="version 1 exists"):
            up.commit("alice", t.upload_id)
    more = [declare(up, base) for _ in range(4)]  # every lost race gave its slot back
    up.abort("alice", more[0].upload_id)
    assert declare(up, base).version == 2
    with pytest.raises(PublishError):  # an aborted upload is gone
        up.commit("alice", more[0].upload_id)


def test_a_lora_adapter_is_checked_against_the_deployments_base_not_the_base_it_names(
    tmp_path: Path, base: Path
) -> None:
    """An adapter is a LoRA of the deployment's base whatever its ``base_model_name_or_path`` says;
    tensors of another rank than its config's, or extra modules, are refused."""
    pytest.importorskip("peft")
    from loom.store.checks import check_checkpoint
    from tests.rollout.test_policy_load_isolation import adapter_of

    bounds = Bounds.of(base, factor=4.0)
    adapter = adapter_of(base, tmp_path / "adapter", "/etc")
    paths = [p.name for p in adapter.iterdir()]
    check_checkpoint(adapter, paths, "lora", bounds)  # the named base is not read

    acfg = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**acfg, "r": 8}))
    with pytest.raises(CheckpointRefused, match="the base model needs"):
        check_checkpoint(adapter, paths, "lora", bounds)
    (adapter / "adapter_config.json").write_text(json.dumps({**acfg, "modules_to_save": ["lm_head"]}))
    with pytest.raises(CheckpointRefused, match="modules_to_save"):
        check_checkpoint(adapter, paths, "lora", bounds)
