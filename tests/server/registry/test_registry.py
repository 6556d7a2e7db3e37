"""The registry's properties, on both backends (a directory and a real S3-compatible server).

Never fatal, converges across replicas, versions from the journal, polls read only what changed.
Replicas here are AdapterRegistry objects with their own live sets in one process (the process-level
versions, with SIGKILL and real servers, are in test_store_durability.py).
"""

from __future__ import annotations

import hashlib
import random
import threading

import pytest
import torch

from memvit.memory_core import MemvitError
from memvit.server.registry import AdapterRegistry
from memvit.server.store import key_of, open_store
from tests.adapters.bundle.test_reader_fuzz import mutate
from tests.server.counting import bundle_reads, counting_requests


def served(registry: AdapterRegistry) -> dict[str, str]:
    """What a replica serves: content hash by name, each made resident (and checked against it)."""
    names = registry.all_names()
    with registry.acquire(names):
        for name in names:
            resident = registry.resident.get(name)
            assert resident is not None and resident.entry.sha256 == registry.get(name).sha256
    return {name: registry.get(name).sha256 for name in names}


def converge(*replicas: AdapterRegistry) -> None:
    for _ in range(2):  # two poll intervals
        for r in replicas:
            r.sync()


def race(*calls) -> list[object]:
    """Run the calls at once (a barrier releases them together); returns each result or exception."""
    barrier, results = threading.Barrier(len(calls)), [None] * len(calls)

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = calls[i]()
        except MemvitError as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_no_object_stops_a_replica_or_blocks_changes(replica, store_location, make_bundle) -> None:
    """Objects of a store written before the journal that are not valid bundles: listed, never fatal."""
    store = open_store(store_location)
    good = make_bundle("good").to_bytes()
    rng = random.Random(0)
    junk = {"empty": b"", "text": b"hello", "huge": b"\0" * ((1 << 22) + 1)}
    junk.update({f"mut{i}": mutate(good, rng) for i in range(20)})
    junk["wrong-name"] = make_bundle("other").to_bytes()
    for name, data in junk.items():
        store._put(key_of(name), data, mode="create")
    store._put(key_of("good"), good, mode="create")
    a = replica()  # starts, migrating the store
    assert "good" in a.catalog
    assert set(a.invalid) >= {"empty", "text", "huge", "wrong-name"}
    assert set(a.invalid) | set(a.all_names()) == {*junk, "good"}
    assert "holds adapter 'other'" in a.invalid["wrong-name"]
    # Changes still work, including deleting an invalid object.
    a.register(make_bundle("new").to_bytes())
    a.delete("text")
    assert "text" not in a.invalid and "new" in a.catalog
    assert key_of("text") not in store._list()  # collected once the journal no longer lists it


@pytest.mark.parametrize("scenario", ["replace/replace", "replace/delete", "create/create", "delete/create"])
def test_conflicting_changes_converge(replica, make_bundle, scenario) -> None:
    a, b = replica(), replica()
    one, two = make_bundle("x", seed=1).to_bytes(), make_bundle("x", seed=2).to_bytes()
    if scenario != "create/create":
        a.register(make_bundle("x", seed=0).to_bytes())
        b.sync()
        served(a), served(b)  # resident on both: their copies must follow the change
    first, second = scenario.split("/")
    ops = {
        "replace": lambda r, data: r.register(data, replace=True),
        "create": lambda r, data: r.register(data),
        "delete": lambda r, data: r.delete("x"),
    }
    results = race(lambda: ops[first](a, one), lambda: ops[second](b, two))
    converge(a, b)
    assert served(a) == served(b), f"replicas disagree after {scenario}: {results}"
    assert a.version == b.version and a.live.current.version == b.live.current.version == a.version
    if scenario == "create/create":
        assert sum(not isinstance(r, Exception) for r in results) == 1  # exactly one winner
    # Whoever won, the original is gone and what is served is one of the two contenders (or nothing).
    allowed = {hashlib.sha256(d).hexdigest() for d in (one, two)} | (
        {None} if "delete" in scenario else set()
    )
    assert served(a).get("x") in allowed


def test_a_replace_reports_the_content_that_is_registered(replica, make_bundle, monkeypatch) -> None:
    """B's replace lands right after A's: A's answer names B's content, and both serve it."""
    a, b = replica(), replica()
    a.register(make_bundle("x", seed=0).to_bytes())
    b.sync()
    mine, theirs = make_bundle("x", seed=1).to_bytes(), make_bundle("x", seed=2).to_bytes()
    claim, raced = a.catalog.journal.claim, []

    def claim_then_race(generation, entry):
        won = claim(generation, entry)
        if won and not raced:
            raced.append(b.register(theirs, replace=True))
        return won

    monkeypatch.setattr(a.catalog.journal, "claim", claim_then_race)
    current, _, replaced = a.register(mine, replace=True)
    assert replaced and current.sha256 == hashlib.sha256(theirs).hexdigest()
    converge(a, b)
    assert served(a) == served(b) == {"x": current.sha256}
    assert torch.equal(a.live.current["x"].weights.head_bias, b.live.current["x"].weights.head_bias)


def test_versions_come_from_the_journal(replica, make_bundle) -> None:
    a, b = replica(), replica()
    versions = [a.version]
    for i in range(4):
        a.register(make_bundle(f"a{i}").to_bytes())
        b.sync()
        assert a.version == b.version == b.live.current.version
        versions.append(b.version)
    b.delete("a0")
    a.sync()
    versions.append(a.version)
    assert versions == list(range(6))  # one per change: strictly increasing
    assert a.live.current.version == b.live.current.version == a.catalog.version
    late = replica()  # a replica that starts now reports the same version for the same content
    assert late.version == a.version and served(late) == served(a)


def test_a_write_never_journaled_is_never_registered(replica, make_bundle) -> None:
    """A writer that dies between its object and its journal entry must not leave two states under
    one version: its object is garbage, registered nowhere, and the versions do not move."""
    a, b = replica(), replica()
    before = a.version
    a.catalog.journal.put_bundle("x", make_bundle("x").to_bytes())  # ... and dies here
    converge(a, b)
    assert "x" not in a.catalog and "x" not in b.catalog and a.version == b.version == before
    b.register(make_bundle("x", seed=3).to_bytes())  # the name is free
    a.sync()
    assert served(a) == served(b)


def test_a_poll_reads_only_what_changed(replica, make_bundle, store_location) -> None:
    a = replica()
    for i in range(6):
        a.register(make_bundle(f"n{i}", seed=i).to_bytes())
    b = replica()
    requests = counting_requests(b.store)
    assert not b.sync() and len(requests) == 1 and bundle_reads(requests) == []  # nothing changed
    served(b)
    assert len(bundle_reads(requests)) == 6  # made resident on demand, each read once
    requests.clear()
    a.register(make_bundle("n3", seed=99).to_bytes(), replace=True)
    assert b.sync() and bundle_reads(requests) == []  # the entry, not the bundle: n3 is evicted
    assert "n3" not in b.resident
    served(b)
    assert [key.split("/")[1] for key in bundle_reads(requests)] == ["n3"]  # one changed: one read
    requests.clear()
    b.register(make_bundle("new").to_bytes())
    assert bundle_reads(requests) == []  # its own registration is resident without a read back
