"""The adapter store on its own: seeding happens once in a store's life, atomically."""

from __future__ import annotations

from server.store import SEEDED_MARKER, AdapterStore


def test_a_new_store_is_seeded_once(tmp_path) -> None:
    store = AdapterStore(tmp_path / "s")
    assert store.seed_once({"a": b"one", "b": b"two"})
    assert sorted(store.scan()) == ["a", "b"] and (store.root / SEEDED_MARKER).is_file()
    store.delete("a")
    store.delete("b")
    assert not store.seed_once({"a": b"one"})  # empty again, but seeded before: stays empty
    assert store.scan() == {}
    assert [p.name for p in store.root.iterdir() if p.name.endswith(".tmp")] == []  # atomic writes


def test_a_store_that_already_has_bundles_is_never_seeded(tmp_path) -> None:
    store = AdapterStore(tmp_path / "s")
    (store.root / "mine.safetensors").write_bytes(b"x")
    assert not store.seed_once({"demo": b"d"})
    (store.root / "mine.safetensors").unlink()
    assert not store.seed_once({"demo": b"d"})  # marked on first sight: never seeded later either
    assert store.scan() == {}
