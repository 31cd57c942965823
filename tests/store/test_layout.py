"""loom.store.layout and loom.store.manifest: which paths name a version folder, and which files a
version's manifest (or a trainer's declaration) lists."""

from __future__ import annotations

from pathlib import Path

from loom.contracts.policies import FILE_SUFFIXES
from loom.store.layout import namespace_root, version_named
from loom.store.manifest import file_hashes, sha256_of


def test_only_a_version_folder_directly_under_the_root_names_a_version(tmp_path: Path) -> None:
    root = tmp_path / "policy"
    (root / "v3").mkdir(parents=True)
    (tmp_path / "elsewhere" / "v4").mkdir(parents=True)
    (root / "v4").symlink_to(tmp_path / "elsewhere" / "v4", target_is_directory=True)
    assert version_named(root, "v3") == 3
    assert version_named(root, str(root / "v3")) == 3
    assert version_named(root, "v5") == 5  # decided on the text: a missing version is the store's 404
    refused = ["v4", "../policy/../elsewhere/v4", "v3/..", "v3/model.safetensors", "x", "/etc", "ns/alice/v1"]
    assert [p for p in refused if version_named(root, p) is not None] == []
    alice = namespace_root(root, "alice")
    assert version_named(alice, str(alice / "v1")) == 1 and version_named(alice, str(root / "v3")) is None


def test_a_manifest_lists_regular_files_but_the_records_and_a_declaration_only_checkpoint_files(
    tmp_path: Path,
) -> None:
    (tmp_path / "tok").mkdir()
    for rel in ("model.safetensors", "tok/vocab.json", "policy.json", "run.sh", ".hidden.json"):
        (tmp_path / rel).write_text(rel)
    (tmp_path / "link.json").symlink_to(tmp_path / "model.safetensors")
    stored = [f["path"] for f in file_hashes(tmp_path)]
    assert stored == ["model.safetensors", "run.sh", "tok/vocab.json"]
    declared = file_hashes(tmp_path, keep=lambda rel: rel.endswith(FILE_SUFFIXES))
    assert [f["path"] for f in declared] == ["model.safetensors", "policy.json", "tok/vocab.json"]
    first = declared[0]
    assert first["size"] == len("model.safetensors") and first["sha256"] == sha256_of(
        tmp_path / "model.safetensors"
    )
