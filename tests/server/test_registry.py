"""The registry's properties, on both backends (a directory and a real S3-compatible server).

Never fatal, converges across replicas, versions from the store, reads only what changed. Replicas
here are AdapterRegistry objects with their own engines in one process (the process-level versions,
with SIGKILL and real servers, are in test_store_durability.py).
"""

from __future__ import annotations

import hashlib
import random
import threading

import pytest
import torch

from memory_core import LiveAdapters, MemoryViT, MemvitError
from server.registry import AdapterRegistry
from server.store import open_store
from tests.adapters.test_bundle_fuzz import mutate
from tests.server.counting import counting_reads


@pytest.fixture
def replica(tiny_weights, store_location):
    def make() -> AdapterRegistry:
        engine = MemoryViT.from_timm(weights=str(tiny_weights))
        service = AdapterRegistry(LiveAdapters(engine), open_store(store_location), max_bundle_bytes=1 << 22)
        service.sync()
        return service

    return make


def served(service: AdapterRegistry) -> dict[str, str]:
    """What a replica serves: content hash by name."""
    return {name: service.get(name).sha256 for name in service.live.current.names}


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
    store = open_store(store_location)
    good = make_bundle("good").to_bytes()
    rng = random.Random(0)
    junk = {"empty": b"", "text": b"hello", "huge": b"\0" * ((1 << 22) + 1)}
    junk.update({f"mut{i}": mutate(good, rng) for i in range(20)})
    junk["wrong-name"] = make_bundle("other").to_bytes()
    for name, data in junk.items():
        store.write(name, data, replace=False)
    store.write("good", good, replace=False)
    a = replica()  # starts
    assert "good" in a.live.current
    assert set(a.invalid) >= {"empty", "text", "huge", "wrong-name"}
    assert set(a.invalid) | set(a.live.current.names) == {*junk, "good"}
    assert "holds adapter 'other'" in a.invalid["wrong-name"]
    # Changes still work, including deleting an invalid object.
    a.register(make_bundle("new").to_bytes())
    a.delete("text")
    assert "text" not in a.invalid and "new" in a.live.current


@pytest.mark.parametrize("scenario", ["replace/replace", "replace/delete", "create/create", "delete/create"])
def test_conflicting_changes_converge(replica, make_bundle, scenario) -> None:
    a, b = replica(), replica()
    one, two = make_bundle("x", seed=1).to_bytes(), make_bundle("x", seed=2).to_bytes()
    if scenario != "create/create":
        a.register(make_bundle("x", seed=0).to_bytes())
        b.sync()
    first, second = scenario.split("/")
    ops = {
        "replace": lambda r, data: r.register(data, replace=True),
        "create": lambda r, data: r.register(data),
        "delete": lambda r, data: r.delete("x"),
    }
    results = race(lambda: ops[first](a, one), lambda: ops[second](b, two))
    converge(a, b)
    assert served(a) == served(b), f"replicas disagree after {scenario}: {results}"
    assert a.live.current.version == b.live.current.version
    if scenario == "create/create":
        assert sum(not isinstance(r, Exception) for r in results) == 1  # exactly one winner
    # Whoever won, the original is gone and what is served is one of the two contenders (or nothing).
    allowed = {hashlib.sha256(d).hexdigest() for d in (one, two)} | (
        {None} if "delete" in scenario else set()
    )
    assert served(a).get("x") in allowed


def test_a_replace_reports_the_content_that_is_live(replica, make_bundle, monkeypatch) -> None:
    """B's replace lands right after A's write: A's answer names B's content, and both serve it."""
    a, b = replica(), replica()
    a.register(make_bundle("x", seed=0).to_bytes())
    b.sync()
    mine, theirs = make_bundle("x", seed=1).to_bytes(), make_bundle("x", seed=2).to_bytes()
    write, raced = a.store.write, []

    def write_then_race(name, data, *, replace):
        version = write(name, data, replace=replace)
        if not raced:
            raced.append(b.register(theirs, replace=True))
        return version

    monkeypatch.setattr(a.store, "write", write_then_race)
    live, _ = a.register(mine, replace=True)
    assert live.sha256 == hashlib.sha256(theirs).hexdigest()
    converge(a, b)
    assert served(a) == served(b) == {"x": live.sha256}
    assert torch.equal(a.live.current["x"].weights.head_bias, b.live.current["x"].weights.head_bias)


def test_versions_come_from_the_store(replica, make_bundle) -> None:
    a, b = replica(), replica()
    versions = [a.live.current.version]
    for i in range(4):
        a.register(make_bundle(f"a{i}").to_bytes())
        b.sync()
        assert a.live.current.version == b.live.current.version
        versions.append(b.live.current.version)
    b.delete("a0")
    a.sync()
    versions.append(a.live.current.version)
    assert versions == sorted(set(versions))  # strictly increasing
    assert a.live.current.version == b.live.current.version == a.store.generation()
    late = replica()  # a replica that starts now reports the same version for the same content
    assert late.live.current.version == a.live.current.version and served(late) == served(a)


def test_an_uncounted_change_is_counted_by_whoever_sees_it(replica, make_bundle, store_location) -> None:
    """A writer that dies between its write and its count must not leave two states under one version."""
    a, b = replica(), replica()
    before = a.live.current.version
    open_store(store_location)._put("x.safetensors", make_bundle("x").to_bytes(), mode="create")
    converge(a, b)
    assert "x" in a.live.current and a.live.current.version > before
    assert a.live.current.version == b.live.current.version


def test_a_poll_reads_only_what_changed(tiny_weights, make_bundle, store_location) -> None:
    store = open_store(store_location)
    for i in range(6):
        store.write(f"n{i}", make_bundle(f"n{i}", seed=i).to_bytes(), replace=False)
    store.write("broken", b"junk", replace=False)

    def replica() -> tuple[AdapterRegistry, list[str]]:
        mine = open_store(store_location)
        reads = counting_reads(mine)
        registry = AdapterRegistry(
            LiveAdapters(MemoryViT.from_timm(weights=str(tiny_weights))), mine, max_bundle_bytes=1 << 22
        )
        registry.sync()
        return registry, reads

    a, a_reads = replica()
    assert len(a_reads) == 7
    assert not a.sync() and len(a_reads) == 7  # nothing changed: nothing read
    store.write("n3", make_bundle("n3", seed=99).to_bytes(), replace=True)
    assert a.sync() and a_reads[7:] == ["n3"]  # one changed: one read (not the broken one again)
    b, b_reads = replica()
    a.register(make_bundle("new").to_bytes())
    assert len(a_reads) == 8  # its own write is not read back
    b.sync()
    assert len(b_reads) == 7 + 1 and b_reads[-1] == "new"
