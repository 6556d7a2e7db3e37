"""The store outlives servers: restarts, SIGKILL mid-registration, replicas sharing one store.

Each test runs on both backends: a local directory and a bucket on a real S3-compatible server.
"""

from __future__ import annotations

import random
import threading
import time

import httpx
import pytest

from memvit.adapters import read_bundle
from memvit.server.registry import Catalog
from memvit.server.store import open_store
from tests.server.conftest import ServerProcess


def _register(url: str, bundle, replace: bool = False) -> int:
    return httpx.post(
        f"{url}/adapters", files={"bundle": ("b", bundle.to_bytes())}, params={"replace": replace}, timeout=30
    ).status_code


def _live(url: str) -> dict:
    body = httpx.get(f"{url}/adapters", params={"limit": 1000}, timeout=30).json()
    return {
        "names": sorted(a["name"] for a in body["adapters"]),
        "version": body["registry"]["version"],
        "invalid": body["invalid"],
        "memory": {a["name"]: a["memory_tokens"] for a in body["adapters"]},
        "sha256": {a["name"]: a["sha256"] for a in body["adapters"]},
    }


def _eventually(check, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return check()
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_restart_keeps_exactly_the_registered_adapters(tiny_weights, store_location, make_bundle) -> None:
    store = store_location
    server = ServerProcess(tiny_weights, store).start()
    try:
        assert _register(server.url, make_bundle("one", m=1)) == 201
        assert _register(server.url, make_bundle("two", m=2)) == 201
        assert _register(server.url, make_bundle("three", m=0, parent="two")) == 201
        assert _register(server.url, make_bundle("gone", m=1)) == 201
        assert httpx.delete(f"{server.url}/adapters/gone").status_code == 200
        assert _register(server.url, make_bundle("one", m=3, seed=2), replace=True) == 201
        before = _live(server.url)
    finally:
        server.stop()
    restarted = ServerProcess(tiny_weights, store).start()
    try:
        after = _live(restarted.url)
    finally:
        restarted.stop()
    assert after == before
    assert after["names"] == ["one", "three", "two"] and after["memory"]["one"] == 3


def test_sigkill_during_registrations_never_corrupts_the_store(
    tiny_weights, store_location, make_bundle
) -> None:
    store = store_location
    bundles = [make_bundle(f"a{i}", m=i % 4, seed=i) for i in range(12)]
    rng = random.Random(0)
    acknowledged: set[str] = set()  # names whose registration the server confirmed with 201

    def hammer(url: str, stop: threading.Event) -> None:
        i = 0
        while not stop.is_set():
            bundle = bundles[i % len(bundles)]
            try:
                if _register(url, bundle, replace=True) == 201:
                    acknowledged.add(bundle.name)
            except httpx.TransportError:
                return  # the server died under us: that is the point
            i += 1

    kills = 2  # per backend: four SIGKILLs in all, each at a random moment of a write stream
    server = ServerProcess(tiny_weights, store).start()
    for round_ in range(kills + 1):
        if round_:  # every start after a kill first checks what the kill left behind
            live = _live(server.url)
            assert live["invalid"] == {}, f"after kill {round_}: corrupted files {live['invalid']}"
            catalog = Catalog(open_store(store))  # what the store's journal registers, read afresh
            catalog.open(_no_legacy, max_bytes=1 << 26)
            assert live["names"] == sorted(catalog.state.adapters) and live["version"] == catalog.version
            for name in catalog.state.adapters:  # every journaled object is there, whole and valid
                read_bundle(catalog.journal.get_bundle(catalog.get(name)))
            assert acknowledged <= set(live["names"]), (
                f"after kill {round_}: a confirmed registration was lost"
            )
        if round_ == kills:
            server.stop()
            break
        stop = threading.Event()
        worker = threading.Thread(target=hammer, args=(server.url, stop))
        worker.start()
        time.sleep(0.3 + rng.random() * 0.7)
        server.kill()  # SIGKILL, mid-write or not
        stop.set()
        worker.join()
        server = ServerProcess(tiny_weights, store).start()
    assert len(acknowledged) >= 3  # the hammer did get registrations through


@pytest.mark.parametrize("poll", ["0.2"])
def test_two_servers_on_one_store_converge(tiny_weights, store_location, make_bundle, poll) -> None:
    store = store_location
    # Both loading at once, as a deployment's replicas start (two imports of torch on two cores: one
    # start's time, not two); the store's creation is made for it (create-if-absent, compare-and-swap).
    a = ServerProcess(tiny_weights, store, MEMVIT_STORE_POLL_SECONDS=poll).spawn()
    b = ServerProcess(tiny_weights, store, MEMVIT_STORE_POLL_SECONDS=poll).spawn()
    try:
        a.wait_ready(120)
        b.wait_ready(120)
        assert _register(a.url, make_bundle("shared", m=1)) == 201
        _eventually(lambda: _check(_live(b.url)["names"] == ["shared"]))
        assert _register(b.url, make_bundle("shared", m=5, seed=3), replace=True) == 201
        _eventually(lambda: _check(_live(a.url)["memory"] == {"shared": 5}))
        assert _live(a.url) == _live(b.url)  # same content hashes and the same version
        assert _register(b.url, make_bundle("child", m=1, parent="shared")) == 201
        _eventually(lambda: _check(_live(a.url)["names"] == ["child", "shared"]))
        # A name taken on one replica is taken on the other.
        assert _register(a.url, make_bundle("child", m=2)) == 409
        assert httpx.delete(f"{a.url}/adapters/child").status_code == 200
        assert httpx.delete(f"{a.url}/adapters/shared").status_code == 200
        _eventually(lambda: _check(_live(b.url)["names"] == []))
        assert _live(a.url) == _live(b.url)
    finally:
        a.stop()
        b.stop()


def _no_legacy(name: str, key: str, data: bytes):
    raise AssertionError("the store was created by the journal: nothing to migrate")


def _check(condition: bool) -> bool:
    assert condition
    return True
