"""The journal and the index on both backends (a directory and a real S3-compatible server): one
winner per slot, changes re-checked after a lost race, damaged objects never skipped, the index
never moving back, and the migration of a store written before the journal, once.

No engine here: entries are built by hand and bundles are plain bytes (the registry's validation
of real bundles is tested in tests/server/registry/).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time

import pytest

from memvit.memory_core import DuplicateAdapterError, UnknownAdapterError
from memvit.server.registry import Catalog
from memvit.server.store import Entry, JournalDamagedError, LocalStore, Snapshot, open_store
from memvit.server.store.journal import BASE_KEY, INDEX_KEY, entry_key
from tests.server.counting import counting_requests


def fake_validate(name: str, key: str, data: bytes) -> Entry:
    """Migration's check of a legacy object: ``ok:<name>[:parent]`` is a bundle, anything else not."""
    text = data.decode(errors="replace")
    if not text.startswith("ok:"):
        raise ValueError("not a memvit bundle")
    _, inner, *parent = text.split(":")
    if inner != name:
        raise ValueError(f"holds adapter {inner!r}")
    return put_entry(name, data, key=key, parent=parent[0] if parent else None)


def put_entry(name: str, data: bytes = b"x", *, key: str | None = None, parent: str | None = None) -> Entry:
    sha = hashlib.sha256(data).hexdigest()
    return Entry("put", name, key or f"bundles/{name}/{sha[:24]}.safetensors", len(data), sha, parent,
                 1, "norm1", ("a", "b"))  # fmt: skip


def opened(location: str, **kwargs) -> Catalog:
    catalog = Catalog(open_store(location), **kwargs)
    catalog.open(fake_validate, max_bytes=1 << 20)
    return catalog


def create(name: str, data: bytes = b"x"):
    """A registration without replace: refused once the name is taken (checked again after a lost race)."""

    def build(state: Snapshot) -> Entry:
        if name in state.adapters:
            raise DuplicateAdapterError(f"{name} is taken")
        return put_entry(name, data)

    return build


def delete(name: str):
    def build(state: Snapshot) -> Entry:
        if name not in state.adapters:
            raise UnknownAdapterError(f"no {name}")
        return Entry("delete", name, state.adapters[name].key)

    return build


def race(*calls) -> list[object]:
    barrier, results = threading.Barrier(len(calls)), [None] * len(calls)

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = calls[i]()
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_a_slot_has_exactly_one_writer(store_location) -> None:
    catalogs = [opened(store_location) for _ in range(6)]
    results = race(*(lambda c=c, i=i: c.journal.claim(1, put_entry(f"n{i}")) for i, c in enumerate(catalogs)))
    assert sorted(results) == [False] * 5 + [True]
    winner = results.index(True)
    assert catalogs[0].refresh()[0].entry.name == f"n{winner}"


def test_concurrent_creates_of_one_name_have_one_winner(store_location) -> None:
    catalogs = [opened(store_location) for _ in range(5)]
    results = race(*(lambda c=c, i=i: c.commit(create("x", b"from %d" % i)) for i, c in enumerate(catalogs)))
    won = [r for r in results if not isinstance(r, Exception)]
    assert len(won) == 1 and all(isinstance(r, DuplicateAdapterError) for r in results if r not in won)
    for c in catalogs:
        c.refresh()
        assert c.version == 1 and c.get("x") == won[0].entry


def test_every_accepted_change_gets_its_own_slot(store_location) -> None:
    catalogs = [opened(store_location) for _ in range(4)]
    calls = [
        lambda c=c, i=i, j=j: c.commit(create(f"n{i}-{j}")) for i, c in enumerate(catalogs) for j in range(3)
    ]
    results = race(*calls)
    assert sorted(r.generation for r in results) == list(range(1, 13))  # type: ignore[union-attr]
    for c in catalogs:
        c.refresh()
        assert len(c) == 12 and c.version == 12


def test_a_loser_checks_its_change_again(store_location) -> None:
    a, b = opened(store_location), opened(store_location)
    a.commit(create("x"))
    b.refresh()
    # Both delete x at once: the second to claim reads the first's entry and finds x gone.
    results = race(lambda: a.commit(delete("x")), lambda: b.commit(delete("x")))
    assert sum(isinstance(r, UnknownAdapterError) for r in results) == 1
    # b still believes y is free; a takes it first; b's create, re-checked after the lost slot, is refused.
    a.commit(create("y"))
    with pytest.raises(DuplicateAdapterError):
        b.commit(create("y"))
    assert b.version == a.version == 3 and "y" in b and "x" not in b


def test_a_writer_killed_between_its_object_and_its_claim_registers_nothing(store_location) -> None:
    a = opened(store_location)
    key, _ = a.journal.put_bundle("x", b"orphan bytes")  # ... and the writer dies here
    restarted = opened(store_location)
    assert "x" not in restarted and restarted.version == 0
    restarted.commit(create("x", b"next writer"))  # the next writer is fine
    assert opened(store_location).get("x").sha256 == hashlib.sha256(b"next writer").hexdigest()
    assert key in open_store(store_location)._list()  # garbage, never a dangling reference


def test_a_damaged_entry_stops_the_journal_until_it_is_repaired(store_location, caplog) -> None:
    a, b = opened(store_location), opened(store_location)
    a.commit(create("x"))
    a.store._put(entry_key(2), b"{not json", mode="create")
    with caplog.at_level(logging.ERROR):
        b.refresh()
    assert b.version == 1 and "x" in b and "is damaged" in (b.damaged or "")
    assert "cannot be skipped" in caplog.text
    with pytest.raises(JournalDamagedError, match="changes are refused"):
        b.commit(create("y"))
    late = opened(store_location)  # a replica starting now stops at the same place
    assert late.version == 1 and late.damaged
    # The operator writes a valid entry in its place: everyone goes on from there.
    a.store._put(entry_key(2), json.dumps(put_entry("z").to_json()).encode(), mode="overwrite")
    b.commit(create("y"))
    assert b.damaged is None and b.version == 3 and {"x", "y", "z"} <= set(b.state.adapters)


def test_a_damaged_index_is_rebuilt_from_the_base_and_the_journal(store_location, caplog) -> None:
    a = opened(store_location, compact_every=2)
    for i in range(5):
        a.commit(create(f"n{i}"))
    a.store._put(INDEX_KEY, b"garbage", mode="overwrite")
    with caplog.at_level(logging.ERROR):
        rebuilt = opened(store_location)
    assert "rebuilding the registry" in caplog.text
    assert rebuilt.version == 5 and sorted(rebuilt.state.adapters) == [f"n{i}" for i in range(5)]
    assert Snapshot.from_bytes(a.store._get(INDEX_KEY)[0], "index").generation == 5  # repaired


def test_the_index_is_compacted_and_never_moves_back(store_location) -> None:
    a = opened(store_location, compact_every=4)
    behind = opened(store_location)  # read the index at 0, then stopped
    behind.refresh()
    for i in range(9):
        a.commit(create(f"n{i}"))
    index = Snapshot.from_bytes(a.store._get(INDEX_KEY)[0], "index")
    assert index.generation == 8  # rewritten by the writer of changes 4 and 8
    behind.state = Snapshot(2, {"n0": put_entry("n0"), "n1": put_entry("n1")})
    assert not behind.journal.save_index(behind.state)  # compare-and-swap on the version it read: lost
    assert Snapshot.from_bytes(a.store._get(INDEX_KEY)[0], "index").generation == 8
    fresh = open_store(store_location)
    requests = counting_requests(fresh)
    c = Catalog(fresh)
    c.open(fake_validate, max_bytes=1 << 20)
    # Start-up: the index, the one entry after it, and the free slot that ends the journal.
    assert [key for _, key in requests] == [INDEX_KEY, entry_key(9), entry_key(10)]
    assert c.version == 9


def test_an_idle_poll_is_one_request_whatever_the_size(store_location) -> None:
    for size in (3, 40):
        location = f"{store_location}-{size}"
        writer = opened(location)
        for i in range(size):
            writer.commit(create(f"n{i}"))
        reader = opened(location)
        requests = counting_requests(reader.store)
        assert reader.refresh() == [] and requests == [("_get", entry_key(size + 1))]
        writer.commit(create("new"))
        requests.clear()
        assert [c.entry.name for c in reader.refresh()] == ["new"]  # one change: one entry read
        assert [key for _, key in requests] == [entry_key(size + 1), entry_key(size + 2)]


def test_a_legacy_store_is_migrated_once(store_location) -> None:
    store = open_store(store_location)
    store._put(".generation", b"7\n", mode="create")
    for name in ("a", "b"):
        store._put(f"{name}.safetensors", f"ok:{name}".encode(), mode="create")
    store._put("kid.safetensors", b"ok:kid:a", mode="create")
    store._put("orphan.safetensors", b"ok:orphan:gone", mode="create")
    store._put("junk.safetensors", b"\x00not a bundle", mode="create")
    store._put("notes.txt", b"not a bundle name: ignored", mode="create")
    results = race(*(lambda: opened(store_location) for _ in range(3)))  # three replicas at once
    assert all(r.version == 7 for r in results), results  # versions carry on from the old counter
    assert all(r.state == results[0].state for r in results)  # they agree
    catalog = results[0]
    assert sorted(catalog.state.adapters) == ["a", "b", "kid"]
    assert catalog.get("a").key == "a.safetensors"  # referenced where it lies
    assert set(catalog.invalid) == {"junk.safetensors", "orphan.safetensors"}
    assert "not a memvit bundle" in catalog.invalid["junk.safetensors"]
    assert "extends 'gone'" in catalog.invalid["orphan.safetensors"]
    assert catalog.commit(create("c")).generation == 8
    # Later starts read the index, never the store's listing or its old bundles again.
    later = Catalog(store)
    requests = counting_requests(store)
    later.open(fake_validate, max_bytes=1 << 20)
    assert "_list" not in {op for op, _ in requests} and later.version == 8
    assert BASE_KEY in store._list()


def test_a_damaged_legacy_generation_counts_on_upwards(store_location) -> None:
    store = open_store(store_location)
    store._put(".generation", b"not a number", mode="create")
    assert opened(store_location).version == 1 << 40


def test_a_new_store_is_seeded_once_and_never_after(store_location) -> None:
    store = open_store(store_location)
    assert store.mark_seeded(empty=True)
    assert not open_store(store_location).mark_seeded(empty=True)  # another replica, or a restart
    other = open_store(f"{store_location}-had")
    assert not other.mark_seeded(empty=False)  # a store with adapters is marked, never seeded
    assert not other.mark_seeded(empty=True)  # not later either, once emptied


def test_local_writes_leave_no_temp_files_and_old_ones_are_cleaned(tmp_path) -> None:
    store = LocalStore(tmp_path / "s")
    catalog = Catalog(store)
    catalog.open(fake_validate, max_bytes=1 << 20)
    key, _ = catalog.journal.put_bundle("a", b"1")
    catalog.commit(create("a"))
    files = sorted(str(p.relative_to(store.root)) for p in store.root.rglob("*") if p.is_file())
    assert [f for f in files if f != ".lock"] == sorted(
        [".index.json", ".journal/0000000000000001.json", ".journal/base.json", key]
    )
    stale = store.root / "bundles" / "a" / ".x.safetensors.abc.tmp"
    stale.write_bytes(b"half")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    assert store.clean_temp_files() == 1 and not stale.exists()
