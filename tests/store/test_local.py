from loom.store import PolicyStore


def test_publish_is_atomic_and_latest_follows(tmp_path):
    store = PolicyStore(tmp_path)
    assert store.latest() is None
    store.publish(1, lambda d: (d / "model.safetensors").write_bytes(b"x"))
    store.publish(2, lambda d: (d / "model.safetensors").write_bytes(b"y"))
    latest = store.latest()
    assert latest is not None and latest.version == 2
    assert (store.path_of(2) / "model.safetensors").read_bytes() == b"y"
    assert not list(tmp_path.glob(".tmp-*"))
    assert store.prune(keep=1) == [1]
    assert store.versions() == [2]


def test_failed_write_leaves_no_visible_version(tmp_path):
    store = PolicyStore(tmp_path)

    def boom(d):
        (d / "partial").write_text("half")
        raise RuntimeError("disk full")

    try:
        store.publish(1, boom)
    except RuntimeError:
        pass
    assert store.versions() == []
    assert store.latest() is None


def test_serving_is_the_version_or_the_newest_above_it(tmp_path):
    """What a replica loads for a requested version (rollout's catch-up, the gateway's check)."""
    reader = PolicyStore(tmp_path / "store", create=False)
    assert reader.serving(1) is None and not (tmp_path / "store").exists()
    store = PolicyStore(tmp_path / "store")
    for version in (1, 2, 3):
        store.publish(version, lambda d: (d / "model.safetensors").write_bytes(b"x"))
    store.prune(keep=1)  # 1 and 2 are gone
    found = [reader.serving(v) for v in (1, 3, 4)]
    assert [p.version if p else None for p in found] == [3, 3, None]


def test_a_published_version_has_its_manifest_and_read_only_files_at_once(tmp_path):
    """Issue 35 finding 8: the manifest is written at publish (the learner's path), not on the first
    request, so bytes changed in between are never vouched for."""
    import json
    import stat

    store = PolicyStore(tmp_path)
    store.publish(1, lambda d: (d / "model.safetensors").write_bytes(b"weights"))
    folder = store.path_of(1)
    files = json.loads((folder / "manifest.json").read_text())
    assert [f["path"] for f in files] == ["model.safetensors"] and files[0]["size"] == 7
    assert not (folder / "model.safetensors").stat().st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)
    try:
        store.publish(1, lambda d: (d / "model.safetensors").write_bytes(b"other"))
    except FileExistsError:
        pass
    assert (folder / "model.safetensors").read_bytes() == b"weights" and not list(tmp_path.glob(".tmp-*"))
