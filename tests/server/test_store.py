"""The adapter store on its own: seeding happens once in a store's life, atomically."""

from __future__ import annotations

from server.store import SEEDED_MARKER, AdapterStore


def test_a_new_store_is_seeded_once(tmp_path) -> None:
    store = AdapterStore(tmp_path / "s")
    (tmp_path / "one").write_bytes(b"one")
    (tmp_path / "two").write_bytes(b"two")
    assert store.seed_once({"a": tmp_path / "one", "b": tmp_path / "two"})
    assert sorted(store.scan()) == ["a", "b"] and (store.root / SEEDED_MARKER).is_file()
    store.delete("a")
    store.delete("b")
    assert not store.seed_once({"a": tmp_path / "one"})  # empty again, but seeded before: stays empty
    assert store.scan() == {}
    assert [p.name for p in store.root.iterdir() if p.name.endswith(".tmp")] == []  # atomic writes


def test_a_store_that_already_has_bundles_is_never_seeded(tmp_path) -> None:
    store = AdapterStore(tmp_path / "s")
    (store.root / "mine.safetensors").write_bytes(b"x")
    assert not store.seed_once({"demo": tmp_path / "missing"})  # not even read
    (store.root / "mine.safetensors").unlink()
    assert not store.seed_once(
        {"demo": tmp_path / "missing"}
    )  # marked on first sight: never seeded later either
    assert store.scan() == {}


def test_a_replace_race_between_two_replicas_converges(
    tiny_weights, tmp_path, make_bundle, monkeypatch
) -> None:
    """Replica B's replace lands right after replica A's rename: both must end up serving B's bytes.

    A used to record the file's state after its rename, i.e. B's file, as "seen" while serving its
    own bundle: the next polls found nothing changed and the replicas disagreed for good.
    """
    import os

    import torch

    from memory_core import MemoryViT
    from server import store as store_module
    from server.adapter_service import AdapterService

    root = tmp_path / "shared"
    a = AdapterService(
        MemoryViT.from_timm(weights=str(tiny_weights)), AdapterStore(root), max_bundle_bytes=1 << 24
    )
    b = AdapterService(
        MemoryViT.from_timm(weights=str(tiny_weights)), AdapterStore(root), max_bundle_bytes=1 << 24
    )
    a.register(make_bundle("x", seed=0).to_bytes())
    b.sync()
    from_a, from_b = make_bundle("x", seed=1), make_bundle("x", seed=2)
    real_replace, raced = os.replace, []

    def replace_then_race(src, dst):
        real_replace(src, dst)
        if not raced:  # B's replace lands between A's rename and A's bookkeeping
            raced.append(True)
            b.register(from_b.to_bytes(), replace=True)

    monkeypatch.setattr(store_module.os, "replace", replace_then_race)
    a.register(from_a.to_bytes(), replace=True)
    monkeypatch.setattr(store_module.os, "replace", real_replace)
    for _ in range(2):  # two poll rounds
        a.sync()
        b.sync()
    expected = from_b.weights.head_bias
    assert torch.equal(b.engine.adapters["x"].weights.head_bias, expected)
    assert torch.equal(a.engine.adapters["x"].weights.head_bias, expected), (
        "replica A still serves its own bytes"
    )
