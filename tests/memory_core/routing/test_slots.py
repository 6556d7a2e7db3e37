"""Adapter slots (memory_core/routing/slots.py): written once, freed with their adapter, reused, grown
in place of nothing; and an adapter's logits do not move when slots around it come and go."""

from __future__ import annotations

import gc

import torch

from memvit.memory_core import LiveAdapters, MemoryViT, plan_pass
from memvit.memory_core.oracle.reference import DenseMemoryViT
from memvit.memory_core.routing.slots import NULL_SLOT, AdapterSlots
from tests.conftest import TOL, images, max_diff, random_adapter, tiny_base, tiny_engine


def test_a_slot_holds_the_prepared_adapter_and_the_null_slot_stays_empty(engine) -> None:
    weights = random_adapter("a", engine, m=3, classes=4)
    prepared = engine.prepare(weights)
    (slot,), pools = engine.slots.assign([(prepared,)])
    assert slot != NULL_SLOT
    assert torch.equal(pools.keys[:, slot, :, :3], prepared.memory_keys)
    assert torch.equal(pools.values[:, slot, :, :3], prepared.memory_values)
    assert pools.memory_length[slot] == 3 and torch.isinf(pools.memory_bias[slot, 3:]).all()
    assert torch.equal(pools.cls[slot], prepared.cls)
    assert torch.equal(pools.head_weight[slot, :4], prepared.head_weight)
    assert not pools.head_weight[slot, 4:].any() and not pools.head_bias[slot, 4:].any()
    assert not pools.cls[NULL_SLOT].any() and not pools.head_weight[NULL_SLOT].any()
    assert pools.memory_length[NULL_SLOT] == 0 and torch.isinf(pools.memory_bias[NULL_SLOT]).all()
    assert engine.slots.assign([(prepared,)])[0] == [slot] and engine.slots.writes == 1  # written once


def test_a_freed_adapter_hands_its_slot_back(engine) -> None:
    slots = engine.slots
    first = engine.prepare(random_adapter("a", engine))
    (slot,), _ = slots.assign([(first,)])
    generation = slots.generation
    assert len(slots) == 1
    del first
    gc.collect()
    second = engine.prepare(random_adapter("b", engine, m=1, classes=3))
    assert slots.assign([(second,)])[0] == [slot]  # the same slot, rewritten
    assert len(slots) == 1 and slots.generation == generation  # no growth


def test_growing_keeps_every_slot_and_its_contents() -> None:
    engine = tiny_engine()
    slots = AdapterSlots(engine.spec, engine.device, engine.dtype, capacity=2)
    adapters = [engine.prepare(random_adapter(f"a{i}", engine, m=1, classes=3)) for i in range(5)]
    assigned, _ = slots.assign([(a,) for a in adapters[:1]])
    before = slots.pools
    more, after = slots.assign([(a,) for a in adapters[1:]])  # 1 free slot: grows, twice
    assert after.capacity >= 6 and after.generation > before.generation
    big = engine.prepare(random_adapter("big", engine, m=9, classes=30))  # longer memory, more classes
    _, grown = slots.assign([(big,)])
    assert (grown.memory, grown.classes) == (16, 32)  # both to powers of two
    for a, s in zip(adapters, assigned + more, strict=True):
        assert torch.equal(grown.keys[:, s, :, :1], a.memory_keys)
        assert torch.equal(grown.head_weight[s, :3], a.head_weight)
        assert not grown.head_weight[s, 3:].any() and torch.isinf(grown.memory_bias[s, 1:]).all()
    assert torch.equal(before.keys[:, assigned[0], :, :1], adapters[0].memory_keys)  # old tensors kept


def test_an_extension_gets_a_slot_per_parent_it_was_stacked_with(engine) -> None:
    child = engine.prepare(random_adapter("child", engine, parent="p"))
    p1 = engine.prepare(random_adapter("p", engine, m=2))
    p2 = engine.prepare(random_adapter("p", engine, m=2, seed=1))
    (s1, s2), pools = engine.slots.assign([(child, p1), (child, p2)])
    assert s1 != s2 and pools.memory_length[s1] == pools.memory_length[s2] == 3  # own 1 + parent's 2
    assert torch.equal(pools.keys[:, s1, :, 1:3], p1.memory_keys)
    assert torch.equal(pools.keys[:, s2, :, 1:3], p2.memory_keys)


def test_logits_do_not_move_across_evictions_slot_reuse_and_growth() -> None:
    engine = tiny_engine()
    live = LiveAdapters(engine)
    weights = [random_adapter(f"a{i}", engine, m=i % 3) for i in range(6)]
    live.replace_all(weights)
    x = images(engine, batch=3)
    _, reference = DenseMemoryViT(engine.base, weights)(x)
    before = engine(x, live.current, tasks=[["a4"], ["a4", "a1"], []])
    for name in ("a0", "a2", "a3", "a5"):
        live.remove(name)
    gc.collect()  # their slots are free now
    for i in range(12):  # reuse them, then grow the pools (longer memory, more classes)
        live.add(random_adapter(f"n{i}", engine, m=i, classes=2 + i))
    assert engine.slots.generation > 0
    after = engine(x, live.current, tasks=[["a4"], ["a4", "a1"], []])
    for name in ("a4", "a1"):
        # Bit for bit even in the default mode: a pass reads the pools only as wide as its own
        # adapters need, so wider ones resident beside them change none of its operations.
        assert torch.equal(after.adapters[name], before.adapters[name])
        assert max_diff(after.adapters[name], reference[name][after.images[name]]) <= TOL
    invariant = MemoryViT(tiny_base(), batch_invariant=True)  # and bit for bit in the invariant mode
    live = LiveAdapters(invariant)
    live.replace_all(weights)
    before = invariant(x, live.current, tasks=[["a4"]] * 3)
    for i in range(12):
        live.add(random_adapter(f"n{i}", invariant, m=i, classes=2 + i))
    assert torch.equal(invariant(x, live.current, tasks=[["a4"]] * 3).adapters["a4"], before.adapters["a4"])


def test_a_plan_reads_the_pools_as_wide_as_its_own_adapters(engine) -> None:
    live = LiveAdapters(engine)
    live.replace_all([random_adapter("a", engine, m=3, classes=5), random_adapter("b", engine, classes=2)])
    live.add(random_adapter("wide", engine, m=20, classes=300))
    plan = plan_pass(live.current, engine.slots, [["a"], ["b"]], 2)
    assert (plan.shape.memory, plan.shape.classes) == (4, 8)  # a's 3 and 5, to powers of two
    assert plan.pools.keys.shape[3] == 4 and plan.pools.head_weight.shape[1] == 8
    assert engine.slots.pools.memory == 32 and engine.slots.pools.classes == 512
    assert plan.pools.keys.data_ptr() == engine.slots.pools.keys.data_ptr()  # views, not copies


def test_slots_assigned_in_inference_mode_can_be_written_outside_it() -> None:
    engine = tiny_engine()
    live = LiveAdapters(engine)
    with torch.inference_mode():  # the first use creates the pools
        live.add(random_adapter("a", engine))
    live.add(random_adapter("b", engine))  # a free slot, written outside it (a server's install)
    with torch.inference_mode():
        live.add(random_adapter("c", engine, m=40, classes=9))  # grows inside it
    live.add(random_adapter("d", engine))
    assert len(engine.slots) == 4 and not engine.slots.pools.keys.is_inference()


def test_a_planned_pass_keeps_the_pools_it_was_planned_with(engine) -> None:
    live = LiveAdapters(engine)
    live.replace_all([random_adapter("a", engine, m=1)])
    x = images(engine, batch=2)
    plan = plan_pass(live.current, engine.slots, None, 2)
    for i in range(40):  # grows the pools while the plan waits
        live.add(random_adapter(f"n{i}", engine, m=7))
    assert engine.slots.pools is not plan.pools
    _, logits = engine.run_plan(x, plan)
    expected = engine(x, live.current, tasks=[["a"], ["a"]]).adapters["a"]
    assert max_diff(logits[:2, : expected.shape[1]], expected) <= TOL


def test_the_all_tasks_heads_gather_a_bounded_chunk_at_a_time(engine, monkeypatch) -> None:
    """The shared layout's heads, where they are gathered (slots not consecutive, or a captured
    pass), run in chunks of rows whose gathered weights stay under ``SHARED_HEAD_BYTES``: the same
    logits, and no (R, C, D) copy of every head per pass."""
    from memvit.memory_core.routing import planned
    from memvit.memory_core.routing.plan import PassPlan

    monkeypatch.setattr(
        PassPlan, "head_run", property(lambda plan: None)
    )  # the gather, as where the slots are scattered

    live = LiveAdapters(engine)
    weights = [random_adapter(f"a{i}", engine, classes=3 + i) for i in range(7)]
    live.replace_all(weights)
    x = images(engine, batch=3)
    whole = engine(x, live.current)
    gathered: list[int] = []
    index_select = torch.Tensor.index_select

    def spy(self, dim, index):
        out = index_select(self, dim, index)
        if self.dim() == 3:  # a gather of heads (S, C, D)
            gathered.append(out.numel() * out.element_size())
        return out

    row = 16 * engine.spec.width * 4  # one head's bytes: C = 16 (9 classes, to a power of two)
    monkeypatch.setattr(planned, "SHARED_HEAD_BYTES", 2 * row)  # two rows per chunk
    monkeypatch.setattr(torch.Tensor, "index_select", spy)
    chunked = engine(x, live.current)
    assert gathered and max(gathered) <= 2 * row and len(gathered) == 4  # 7 rows: 2 + 2 + 2 + 1
    _, reference = DenseMemoryViT(engine.base, weights)(x)
    for w in weights:
        assert torch.equal(chunked.adapters[w.name], whole.adapters[w.name])
        assert max_diff(chunked.adapters[w.name], reference[w.name]) <= TOL
