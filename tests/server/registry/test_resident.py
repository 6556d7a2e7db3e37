"""Registered is not resident: adapters loaded on demand, one read however many ask, the least
recently used evicted, pinned ones never, a failed load changing nothing, and an adapter's logits
independent of what else is resident, bit for bit."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from memvit.server.errors import ResidentSetFullError, TasksRequiredError, TooManyTasksError, UnknownTaskError
from memvit.server.inference.tasks import check_tasks
from memvit.server.store import StoreUnavailableError
from tests.conftest import images
from tests.server.counting import bundle_reads, counting_requests
from tests.server.filling import register_in_bulk


@pytest.mark.parametrize("size", [10, 300])
def test_an_idle_poll_costs_one_request_whatever_the_size(replica, bundles, store_location, size) -> None:
    location = f"{store_location}-{size}"
    from memvit.server.store import open_store

    register_in_bulk(open_store(location), bundles([f"a{i:03d}" for i in range(size)], m=0, classes=2))
    registry = replica(location)
    assert len(registry) == size and len(registry.resident) == 0  # registered, none resident
    requests = counting_requests(registry.store)
    for _ in range(3):
        assert not registry.sync()
    assert len(requests) == 3  # one GET of the next journal slot per poll, at any size


def test_a_hundred_requests_for_one_cold_adapter_read_it_once(replica, make_bundle) -> None:
    writer = replica()
    writer.register(make_bundle("cold").to_bytes())
    reader = replica()
    requests = counting_requests(reader.store)
    pins, barrier = [], threading.Barrier(50)

    def ask() -> None:
        barrier.wait()
        pins.append(reader.acquire(["cold"]))

    threads = [threading.Thread(target=ask) for _ in range(50)]
    for t in threads:
        t.start()

    async def fifty_more() -> list:
        return await asyncio.gather(*(reader.acquire_async(["cold"]) for _ in range(50)))

    pins += asyncio.run(fifty_more())
    for t in threads:
        t.join()
    assert len(pins) == 100 and reader.resident.loads == 1 and len(bundle_reads(requests)) == 1
    assert reader.resident.pinned("cold")
    for pin in pins:
        pin.release()
    assert not reader.resident.pinned("cold") and "cold" in reader.resident


def test_eviction_keeps_what_is_asked_for_again_and_never_what_is_pinned(replica, make_bundle) -> None:
    """Segmented LRU: adapters asked for once are evicted first (least recently used first), then
    those asked for again while resident; a pinned one never."""
    writer = replica()
    for name in "abcdef":
        writer.register(make_bundle(name).to_bytes())
    r = replica(resident_adapters=3)  # protected: 2 at most
    for name in "abc":
        r.acquire([name]).release()
    r.acquire(["a"]).release()  # asked again: protected; b is now the oldest on probation
    r.acquire(["d"]).release()
    assert sorted(r.live.current.names) == ["a", "c", "d"]
    held = r.acquire(["c"])  # protected too, and pinned while its batch would run
    r.acquire(["e"]).release()  # evicts d, the only one on probation
    assert sorted(r.live.current.names) == ["a", "c", "e"]
    r.acquire(["e"]).release()  # a third protected one: a, the least recently used, falls back
    r.acquire(["f"]).release()  # ... and is the one evicted, not c (pinned) nor e
    assert sorted(r.live.current.names) == ["c", "e", "f"]
    with r.acquire(["e"]), r.acquire(["f"]), pytest.raises(ResidentSetFullError, match="in use"):
        r.acquire(["a"])  # c, e and f are all pinned: refused (503), nothing over-filled
    assert sorted(r.live.current.names) == ["c", "e", "f"] and len(r.resident) == 3
    held.release()
    r.acquire(["a"]).release()
    assert "a" in r.resident and len(r.resident) == 3


def test_each_adapter_asked_for_counts_as_a_hit_or_a_miss(replica, make_bundle) -> None:
    writer = replica()
    for name in "abc":
        writer.register(make_bundle(name).to_bytes())
    r = replica(resident_adapters=2)
    r.acquire(["a", "b"]).release()  # both cold: loaded for this request
    r.acquire(["a"]).release()
    r.acquire(["c"]).release()  # evicts b
    r.acquire(["b", "a"]).release()
    assert r.resident.lookups == {"hit": 2, "miss": 4}
    assert r.resident.loads == 4


def test_a_request_needing_more_than_the_cap_is_refused(replica, make_bundle) -> None:
    r = replica(resident_adapters=3)
    r.register(make_bundle("p").to_bytes())
    for name in ("k1", "k2", "k3"):
        r.register(make_bundle(name, parent="p").to_bytes())
    with pytest.raises(TooManyTasksError, match="at most 3"):
        r.acquire(["k1", "k2", "k3"])  # 3 asked, 4 needed: an extension needs its parent resident
    with r.acquire(["k2", "k3"]):  # parents first, loaded before their extensions
        assert r.live.current.names.index("p") < r.live.current.names.index("k2")


def test_the_byte_budget_bounds_the_set_and_names_itself(replica, make_bundle) -> None:
    writer = replica()
    for name in "abc":
        writer.register(make_bundle(name, m=1).to_bytes())
    writer.register(make_bundle("big", m=40).to_bytes())
    one = writer.resident.get("a").nbytes
    r = replica(resident_bytes=2 * one + one // 2)  # room for two small adapters
    for name in "abc":
        r.acquire([name]).release()
    assert sorted(r.live.current.names) == ["b", "c"] and r.resident.nbytes <= 2 * one + one // 2
    with pytest.raises(TooManyTasksError, match="MEMVIT_RESIDENT_BYTES"):
        r.acquire(["big"])  # alone over the budget: a 413, not a 503 to retry
    assert sorted(r.live.current.names) == ["b", "c"]


def test_a_store_outage_during_a_cold_load_is_a_503_and_changes_nothing(replica, make_bundle) -> None:
    writer = replica()
    for name in ("warm", "cold"):
        writer.register(make_bundle(name).to_bytes())
    r = replica(resident_adapters=1)
    r.acquire(["warm"]).release()
    before = r.live.current
    get = r.store._get

    def down(key, *args, **kwargs):
        if key.endswith(".safetensors"):
            raise StoreUnavailableError(f"adapter store {r.store.location}: get {key} failed: refused")
        return get(key, *args, **kwargs)

    r.store._get = down  # type: ignore[method-assign]
    with pytest.raises(StoreUnavailableError, match="adapter 'cold' could not be loaded"):
        r.acquire(["cold"])
    assert r.live.current is before and "warm" in r.resident  # nothing evicted
    assert not r.resident.pinned("cold")
    r.store._get = get  # type: ignore[method-assign]
    r.acquire(["cold"]).release()
    assert r.live.current.names == ("cold",)


def test_unknown_names_refresh_once_then_422(replica, make_bundle) -> None:
    a, b = replica(), replica()
    b.register(make_bundle("fresh").to_bytes())  # on another replica, a moment ago
    asyncio.run(check_tasks(["base", "fresh"], a))  # found: a refreshed its catalog for it
    assert "fresh" in a.catalog
    with pytest.raises(UnknownTaskError, match=r"unknown task\(s\) \['nope'\]"):
        asyncio.run(check_tasks(["nope"], a))
    requests = counting_requests(a.store)
    for _ in range(20):  # a flood of unknown names: refreshes are rate-limited
        with pytest.raises(UnknownTaskError):
            asyncio.run(check_tasks(["nope"], a))
    assert len(requests) <= 3


def test_no_filter_only_while_the_registry_is_small(replica, make_bundle) -> None:
    r = replica(max_tasks=2)
    for name in "ab":
        r.register(make_bundle(name).to_bytes())
    asyncio.run(check_tasks(None, r))
    r.register(make_bundle("c").to_bytes())
    with pytest.raises(TasksRequiredError, match="holds 3 adapters: name the tasks you want"):
        asyncio.run(check_tasks(None, r))
    with pytest.raises(TooManyTasksError, match="3 adapters asked for in one request; the limit is 2"):
        asyncio.run(check_tasks(["a", "b", "c"], r))
    asyncio.run(check_tasks(["base", "a", "c"], r))


def test_a_bundle_that_does_not_validate_here_is_refused_and_listed(replica, make_bundle) -> None:
    writer = replica()
    writer.register(make_bundle("x").to_bytes())
    entry = writer.get("x")
    writer.store._put(entry.key, b"changed behind the journal's back", mode="overwrite")
    r = replica()
    with pytest.raises(UnknownTaskError, match=r"cannot be served here: .*SHA-256 differs"):
        r.acquire(["x"])
    assert "SHA-256 differs" in r.invalid["x"] and "x" not in r.resident
    requests = counting_requests(r.store)
    with pytest.raises(UnknownTaskError):
        r.acquire(["x"])  # known bad: not read again until the registry changes it
    assert bundle_reads(requests) == [] and len(r.resident) == 0
    writer.register(make_bundle("x", seed=1).to_bytes(), replace=True)
    r.sync()
    assert "x" not in r.invalid
    r.acquire(["x"]).release()


def test_logits_do_not_depend_on_what_else_is_resident(replica, make_bundle) -> None:
    writer = replica()
    names = [f"n{i}" for i in range(6)]
    for i, name in enumerate(names):
        writer.register(make_bundle(name, m=i % 3, classes=3 + i).to_bytes())
    r = replica(resident_adapters=3)
    x = images(r.engine, batch=2)

    def logits(name: str) -> torch.Tensor:
        with r.acquire([name]), torch.inference_mode():
            return r.engine(x, r.live.current, tasks=[[name], [name]]).adapters[name].clone()

    first = logits("n0")
    for name in names[1:]:  # n0 is evicted by the others (3 resident at most)
        logits(name)
    assert "n0" not in r.resident
    again = logits("n0")  # loaded again, among other neighbours
    assert torch.equal(first, again)
    assert r.resident.loads == 7


def test_requests_asking_the_same_adapters_pin_them_as_a_group(replica, make_bundle) -> None:
    """The first pins each adapter, the others count on it (O(1) a request); the adapters stay
    pinned until the last lets go; a change meanwhile makes the next request pin its own."""
    writer = replica()
    for name in "abcd":
        writer.register(make_bundle(name).to_bytes())
    r = replica(resident_adapters=3)
    first = r.acquire(["a", "b"])  # loads them: a pin of its own
    first.release()
    pins = [r.acquire(["a", "b"]) for _ in range(3)]  # resident now: one group, three holders
    assert r.resident._groups[("a", "b")][0] == 3 and r.resident._pins["a"] == 1
    pins[0].release()
    pins[1].release()
    assert r.resident.pinned("a") and r.resident.pinned("b")  # the last holder keeps them
    r.acquire(["c"]).release()
    r.acquire(["d"]).release()  # the set is full: c goes, never a or b
    assert sorted(r.live.current.names) == ["a", "b", "d"]
    late = r.acquire(["a", "b"])  # the set changed since the group formed: its own pins
    assert r.resident._pins["a"] == 2
    pins[2].release()
    late.release()
    assert not r.resident.pinned("a") and not r.resident._groups
    assert r.resident.lookups == {"hit": 8, "miss": 4}
