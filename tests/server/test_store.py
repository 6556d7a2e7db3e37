"""The adapter store on its own, on both backends: atomic create, generation, seeding once."""

from __future__ import annotations

import threading

import pytest

from memory_core import DuplicateAdapterError, UnknownAdapterError
from server.store import SEEDED_KEY, LocalStore, ObjectStore, ObjectTooLargeError, open_store


def test_open_store_picks_the_backend(tmp_path, s3_env) -> None:
    assert isinstance(open_store(tmp_path / "dir"), LocalStore)
    assert isinstance(open_store(f"file://{tmp_path}/dir2"), LocalStore)
    from tests.server.s3 import new_bucket

    assert isinstance(open_store(f"s3://{new_bucket(s3_env)}/p"), ObjectStore)
    with pytest.raises(ValueError, match="unsupported adapter store URL"):
        open_store("ftp://somewhere/x")


def test_write_read_delete(store_location) -> None:
    store = open_store(store_location)
    first = store.write("a", b"one", replace=False)
    data, version = store.read("a")
    assert (data, version) == (b"one", first) and store.scan() == {"a": first}
    with pytest.raises(DuplicateAdapterError):
        store.write("a", b"two", replace=False)
    second = store.write("a", b"two", replace=True)
    assert second != first and store.read("a") == (b"two", second)
    with pytest.raises(ObjectTooLargeError):
        store.read("a", max_bytes=2)
    store.delete("a")
    assert store.scan() == {}
    with pytest.raises(UnknownAdapterError):
        store.delete("a")
    with pytest.raises(UnknownAdapterError):
        store.read("a")
    assert store.generation() == 3  # create, replace, delete: refused changes do not count


def test_create_has_exactly_one_winner_and_every_bump_counts(store_location) -> None:
    store = open_store(store_location)
    winners, barrier = [], threading.Barrier(6)

    def create(i: int) -> None:
        barrier.wait()
        try:
            store.write("x", b"from %d" % i, replace=False)
            winners.append(i)
        except DuplicateAdapterError:
            pass

    threads = [threading.Thread(target=create, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(winners) == 1
    assert store.read("x")[0] == b"from %d" % winners[0]
    # Concurrent generation bumps (compare-and-swap) all count.
    bumps = [threading.Thread(target=lambda: [store.bump_generation() for _ in range(5)]) for _ in range(4)]
    for t in bumps:
        t.start()
    for t in bumps:
        t.join()
    assert store.generation() == 1 + 20


def test_a_damaged_generation_counts_on_upwards(store_location) -> None:
    store = open_store(store_location)
    store.bump_generation()
    store._put(".generation", b"not a number", mode="overwrite")
    assert store.generation() >= 1 << 40
    assert store.bump_generation() == (1 << 40) + 1


def test_a_new_store_is_seeded_once(store_location, tmp_path) -> None:
    store = open_store(store_location)
    (tmp_path / "one").write_bytes(b"one")
    (tmp_path / "two").write_bytes(b"two")
    assert store.seed_once({"a": tmp_path / "one", "b": tmp_path / "two"})
    assert sorted(store.scan()) == ["a", "b"] and SEEDED_KEY in store._list()
    assert not open_store(store_location).seed_once({"a": tmp_path / "one"})  # a second replica
    store.delete("a")
    store.delete("b")
    assert not store.seed_once({"a": tmp_path / "one"})  # empty again, but seeded before: stays empty
    assert store.scan() == {}


def test_a_store_that_already_has_bundles_is_never_seeded(store_location, tmp_path) -> None:
    store = open_store(store_location)
    store.write("mine", b"x", replace=False)
    assert not store.seed_once({"demo": tmp_path / "missing"})  # not even read
    store.delete("mine")
    # Marked on first sight: never seeded later either.
    assert not store.seed_once({"demo": tmp_path / "missing"})
    assert store.scan() == {}


def test_local_writes_leave_no_temp_files(tmp_path) -> None:
    store = LocalStore(tmp_path / "s")
    store.write("a", b"1", replace=False)
    store.write("a", b"2", replace=True)
    store.bump_generation()
    assert sorted(p.name for p in store.root.iterdir()) == [".generation", ".lock", "a.safetensors"]


def test_an_unreachable_object_store_is_a_clear_error(monkeypatch) -> None:
    from server.store import StoreUnavailableError
    from tests.server.launcher import free_port

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    with pytest.raises(StoreUnavailableError, match="s3://nowhere/p: list failed"):
        ObjectStore("s3://nowhere/p", request_timeout_s=2).check()
