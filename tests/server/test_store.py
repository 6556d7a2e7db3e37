"""The adapter store's primitives on both backends: nested keys, atomic create, compare-and-swap."""

from __future__ import annotations

import threading

import pytest

from memvit.server.store import GENERATION_KEY, LocalStore, ObjectStore, ObjectTooLargeError, open_store
from memvit.server.store.base import ObjectChangedError, ObjectExistsError


def test_open_store_picks_the_backend(tmp_path, s3_env) -> None:
    assert isinstance(open_store(tmp_path / "dir"), LocalStore)
    assert isinstance(open_store(f"file://{tmp_path}/dir2"), LocalStore)
    from tests.server.s3 import new_bucket

    assert isinstance(open_store(f"s3://{new_bucket(s3_env)}/p"), ObjectStore)
    with pytest.raises(ValueError, match="unsupported adapter store URL"):
        open_store("ftp://somewhere/x")


def test_the_primitives_on_nested_keys(store_location) -> None:
    """What the journal is built on, the same on both backends: keys with ``/``, create-if-absent,
    replace-if-unchanged, a clear absent key (the journal, its index and the bundles: test_journal.py)."""
    store = open_store(store_location)
    key = "bundles/a/0123-abcd.safetensors"
    first = store._put(key, b"one", mode="create")
    assert store._get(key) == (b"one", first) and key in store._list()
    with pytest.raises(ObjectExistsError):
        store._put(key, b"two", mode="create")
    second = store._put(key, b"two", mode=first)  # replace-if-unchanged, on the version read
    assert second != first and store._get(key)[0] == b"two"
    with pytest.raises(ObjectChangedError):
        store._put(key, b"three", mode=first)  # that version is gone
    with pytest.raises(ObjectTooLargeError):
        store._get(key, 2)
    store._delete(key)
    with pytest.raises(FileNotFoundError):
        store._get(key)
    with pytest.raises(FileNotFoundError):
        store._delete(key)


def test_create_if_absent_has_exactly_one_winner(store_location) -> None:
    store = open_store(store_location)
    winners, barrier = [], threading.Barrier(6)

    def create(i: int) -> None:
        barrier.wait()
        try:
            store._put(".journal/0000000000000001.json", b"from %d" % i, mode="create")
            winners.append(i)
        except ObjectExistsError:
            pass

    threads = [threading.Thread(target=create, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(winners) == 1
    assert store._get(".journal/0000000000000001.json")[0] == b"from %d" % winners[0]


def test_legacy_bundles_are_the_root_level_safetensors(store_location) -> None:
    store = open_store(store_location)
    for key in ("a.safetensors", "bundles/b/x.safetensors", ".hidden.safetensors", "notes.txt"):
        store._put(key, b"x", mode="create")
    assert store.legacy_bundles() == {"a": "a.safetensors"}
    assert store.legacy_generation() == 0
    store._put(GENERATION_KEY, b"7\n", mode="create")
    assert store.legacy_generation() == 7


def test_an_unreachable_object_store_is_a_clear_error(monkeypatch) -> None:
    from memvit.server.store import StoreUnavailableError
    from tests.server.launcher import free_port

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    with pytest.raises(StoreUnavailableError, match="s3://nowhere/p: list failed"):
        ObjectStore("s3://nowhere/p", request_timeout_s=2).check()
