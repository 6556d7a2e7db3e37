"""Slot pools grown ahead (memory_core/routing/slots.py ``grow_ahead``/``publish``): the growing thread
alone reads the grown pools until it publishes them; every other thread's passes read the published
ones, its writes go into both, and one that needs the grown pools publishes them."""

from __future__ import annotations

import threading

import pytest
import torch

from benchmarks.host_counts import StandInEvent, StandInGraphs
from memvit.memory_core import LiveAdapters
from memvit.memory_core.oracle.reference import DenseMemoryViT
from memvit.memory_core.routing.slots import AdapterSlots
from memvit.memory_core.routing.staging import HostBuffers
from tests.conftest import TOL, images, max_diff, random_adapter, tiny_engine


def prepared(engine, names, **kwargs):
    return [(engine.prepare(random_adapter(n, engine, **kwargs)),) for n in names]


def in_thread(work):
    """Run ``work`` on another thread: (the thread, a dict that gets its result or its error)."""
    out: dict = {}

    def run() -> None:
        try:
            out["result"] = work()
        except Exception as exc:  # the test reads it
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


@pytest.fixture
def engine():
    return tiny_engine()


def graphed_engine():
    """An engine whose passes run as stand-in graphs (the capture one eager pass, the replay the pass
    again over the captured inputs and pools: benchmarks/host_counts.py), as a GPU's would."""
    engine = tiny_engine()
    buffers = HostBuffers(pinned=False, new_event=StandInEvent.factory())
    engine.use_graphs(StandInGraphs(buffers=buffers, replays=True))
    return engine


def install_all(live: LiveAdapters, weights) -> None:
    """One install adding every one of ``weights`` to the live set (the pools grow once)."""
    prepared_ = [live.engine.prepare(w) for w in weights]
    with live.exclusive() as current:
        for p in prepared_:
            current = current.with_adapter(p)
        live.install(current)


def test_only_what_does_not_fit_grows_ahead(engine) -> None:
    slots = AdapterSlots(engine.spec, engine.device, engine.dtype, capacity=4)
    slots.assign(prepared(engine, ["a"], m=1, classes=3))
    assert not slots.grow_ahead(prepared(engine, ["b", "c"], m=1, classes=3))  # 3 free slots
    assert not slots.growing_ahead
    assert slots.grow_ahead(prepared(engine, ["d"], m=1, classes=30))  # more classes than the pools
    assert slots.growing_ahead and slots.pools.classes == 32
    with pytest.raises(RuntimeError, match="already grows"):
        slots.grow_ahead(prepared(engine, ["e"], m=9))
    thread, out = in_thread(slots.publish)  # another thread's pools are not this one's to publish
    thread.join(5)
    assert "another thread grows" in str(out["error"])
    slots.publish()
    slots.publish()  # nothing left: nothing done


def test_the_grown_pools_are_the_growing_threads_alone_until_published(engine) -> None:
    slots = AdapterSlots(engine.spec, engine.device, engine.dtype, capacity=2)
    (old,) = prepared(engine, ["old"], m=1, classes=3)
    (old_slot,), published = slots.assign([old])
    new = prepared(engine, ["n0", "n1", "n2"], m=2, classes=5)
    assert slots.grow_ahead(new)
    pending = slots.pools
    assert pending is not published and pending.generation == published.generation + 1
    assert pending.capacity >= 5 and torch.equal(pending.keys[:, old_slot, :, :1], old[0].memory_keys)
    new_slots, pools = slots.assign(new)  # this thread: into the pending pools alone
    assert pools is pending and max(new_slots) >= published.capacity
    # Another thread reads the published pools, and does not see the new slots yet.
    thread, seen = in_thread(lambda: (slots.pools, slots.generation, slots.slot_of(new[0][0])))
    thread.join(5)
    assert seen["result"] == (published, published.generation, None)
    slots.publish()
    assert slots.pools is pending and slots.slot_of(new[0][0]) == new_slots[0]
    for (adapter,), slot in zip(new, new_slots, strict=True):
        assert torch.equal(pending.keys[:, slot, :, :2], adapter.memory_keys)
        assert torch.equal(pending.head_weight[slot, :5], adapter.head_weight)


def test_another_threads_write_goes_into_both_pools(engine) -> None:
    slots = AdapterSlots(engine.spec, engine.device, engine.dtype, capacity=8)
    slots.assign(prepared(engine, ["a"], m=1, classes=3))
    assert slots.grow_ahead(prepared(engine, ["wide"], m=1, classes=40))
    (fits,) = prepared(engine, ["fits"], m=1, classes=3)
    thread, out = in_thread(lambda: slots.assign([fits]))
    thread.join(5)
    (slot,), published = out["result"]
    pending = slots.pools
    assert published is not pending
    for pools in (published, pending):  # a pass planned before the publish, and one after
        assert torch.equal(pools.keys[:, slot, :, :1], fits[0].memory_keys)
        assert torch.equal(pools.head_weight[slot, :3], fits[0].head_weight)
    slots.publish()


@pytest.mark.parametrize("needs", ["an unpublished slot", "a growth"])
def test_another_thread_that_needs_the_grown_pools_publishes_them(engine, needs) -> None:
    """Not a wait: the growing thread may itself be waiting for that thread (a pass holding the
    graphs' lock while it plans, which a capture needs)."""
    slots = AdapterSlots(engine.spec, engine.device, engine.dtype, capacity=4)
    new = prepared(engine, ["n"], m=3, classes=3)
    assert slots.grow_ahead(new)
    (slot,), pending = slots.assign(new)
    asked = new if needs == "an unpublished slot" else prepared(engine, ["wider"], m=1, classes=70)
    thread, out = in_thread(lambda: slots.assign(asked))
    thread.join(5)
    (got,), pools = out["result"]
    assert not slots.growing_ahead  # published by the other thread
    if needs == "an unpublished slot":
        assert got == slot and pools is pending  # the same slot, not a second copy
    else:  # grown from the published pools, which hold what the growing thread wrote
        assert pools.classes == 128 and torch.equal(pools.keys[:, slot, :, :3], new[0][0].memory_keys)
    slots.publish()  # the growing thread's publish: nothing left to do
    assert slots.pools is pools


def test_passes_beside_a_growth_ahead_answer_right() -> None:
    """Passes of another thread while pools grow ahead (on the published pools, their graphs), and
    the growing thread's on the grown pools (graphs captured for them, none dropped), against the
    dense reference; after the publish, every adapter, old and new, answers right with no capture."""
    engine = graphed_engine()
    graphs = engine._graphs()
    live = LiveAdapters(engine)
    weights = [random_adapter(f"a{i}", engine, m=1 + i % 2, classes=3 + i) for i in range(3)]
    live.replace_all(weights)
    more = [random_adapter(f"n{i}", engine, m=5, classes=20 + i) for i in range(20)]  # past 16 slots
    x = images(engine, batch=3)
    _, reference = DenseMemoryViT(engine.base, weights + more)(x)
    routed, old_routed = [["n19"], ["a1", "n3"], ["a2"]], [["a0"], ["a1"], ["a2"]]
    engine(x, live.current, tasks=old_routed)  # its graph, on the published pools
    beside: list = []

    def on_growth(adapter_set) -> None:
        assert engine.slots.growing_ahead and engine.slots.pools.capacity > 16
        beside.append(engine(x, adapter_set, tasks=routed))  # captured for the grown pools
        thread, out = in_thread(lambda: engine(x, live.current, tasks=old_routed))
        thread.join(30)
        beside.append(out["result"])  # the published pools and their graph: the set before

    live.on_growth = on_growth
    generation, captured = engine.slots.generation, graphs.captures
    install_all(live, more)
    assert engine.slots.generation == generation + 1 and not engine.slots.growing_ahead
    assert len(beside) == 2 and graphs.captures == captured and graphs.captures_beside > 0
    after = engine(x, live.current, tasks=routed)
    assert graphs.captures == captured  # replayed what the growth captured
    for out in (*beside, after):
        for name, logits in out.adapters.items():
            assert max_diff(logits, reference[name][out.images[name]]) <= TOL, name


def test_the_hook_runs_only_when_the_pools_grow_and_a_failure_costs_it_alone(caplog) -> None:
    engine = graphed_engine()
    live = LiveAdapters(engine)
    calls: list[int] = []

    def on_growth(adapter_set) -> None:
        calls.append(len(adapter_set))
        raise RuntimeError("no room for graphs")

    live.replace_all([random_adapter(f"a{i}", engine, m=1) for i in range(4)])  # (the first grows)
    live.on_growth = on_growth
    live.add(random_adapter("fits", engine, m=1))  # 16 slots, m = 1: fits
    assert calls == []
    install_all(live, [random_adapter(f"n{i}", engine, m=1) for i in range(20)])
    assert calls == [25] and len(live.current) == 25 and not engine.slots.growing_ahead
    assert "preparing the grown slot pools' passes failed" in caplog.text
    out = engine(images(engine, batch=2), live.current, tasks=[["n19"], ["a0"]])
    assert set(out.adapters) == {"n19", "a0"}


def test_a_pass_that_needs_a_growth_of_its_own_beside_the_hook_does_not_wait_for_it() -> None:
    """A pass over a set never installed, on another thread, needing wider pools while an install's
    hook captures (a pass plans under the graphs' lock, which the hook's captures need): it publishes
    the grown pools, grows them again, and answers; the install then completes."""
    engine = graphed_engine()
    live = LiveAdapters(engine)
    weights = [random_adapter("a0", engine, m=1, classes=3)]
    live.replace_all(weights)
    wide = random_adapter("wide", engine, m=2, classes=300)
    other = engine.prepare_set([*weights, wide])  # not installed: written on first use
    x = images(engine, batch=2)
    done: list = []

    def on_growth(adapter_set) -> None:
        thread, out = in_thread(lambda: engine(x, other, tasks=[["wide"], ["a0"]]))
        thread.join(10)
        done.append((thread.is_alive(), out))
        if not thread.is_alive():  # (else its pass holds the graphs' lock: this one would wait forever)
            engine(x, adapter_set, tasks=[["n0"], ["a0"]])  # its own pass goes on too

    live.on_growth = on_growth
    install_all(live, [random_adapter(f"n{i}", engine, m=1, classes=20) for i in range(20)])
    ((waited, out),) = done
    assert not waited
    _, reference = DenseMemoryViT(engine.base, [*weights, wide])(x)
    out = out["result"]
    assert max_diff(out.adapters["wide"], reference["wide"][out.images["wide"]]) <= TOL
    assert len(live.current) == 21 and not engine.slots.growing_ahead
