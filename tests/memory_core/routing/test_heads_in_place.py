"""The all-tasks heads read in place (memory_core/routing/planned.py ``shared_heads``): where a shared
plan's slots are consecutive (``PassPlan.head_run``) and the pass is not captured, the heads are one
view of the pool, not a gather; every image's logits are the same bits as the gather's."""

from __future__ import annotations

import pytest
import torch

from memvit.memory_core import LiveAdapters, plan_pass
from memvit.memory_core.oracle.reference import DenseMemoryViT
from memvit.memory_core.routing import planned
from memvit.memory_core.routing.plan import PassPlan
from tests.conftest import TOL, images, max_diff, random_adapter


def heads_gathered(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the bytes of every gather of heads (an ``index_select`` of a (S, C, D) pool)."""
    gathered: list[int] = []
    index_select = torch.Tensor.index_select

    def spy(self, dim, index):
        out = index_select(self, dim, index)
        if self.dim() == 3 and dim == 0 and self.shape[1:] == out.shape[1:] and self.shape[-1] > 1:
            gathered.append(out.numel() * out.element_size())
        return out

    monkeypatch.setattr(torch.Tensor, "index_select", spy)
    return gathered


def test_a_run_of_slots_is_found_on_the_host_and_only_there(engine) -> None:
    live = LiveAdapters(engine)
    live.replace_all(random_adapter(f"a{i}", engine, classes=3 + i) for i in range(5))
    plan = plan_pass(live.current, engine.slots, None, 2)
    slots = plan.tensors(engine.device).row_slots
    assert plan.head_run == int(slots[0]) and torch.equal(slots, torch.arange(5) + plan.head_run)
    routed = plan_pass(live.current, engine.slots, [["a0", "a3"], ["a1"]], 2)
    assert routed.head_run is None  # routed: each output's head is gathered
    live.remove("a2")
    live.add(random_adapter("late", engine, classes=4))  # rows in the set's order, slots not
    scattered = plan_pass(live.current, engine.slots, None, 2)
    rows = scattered.tensors(engine.device).row_slots
    assert (rows.diff() != 1).any()  # the freed slot reused: 1, 2, 4, 5, 3
    assert scattered.head_run is None


def test_consecutive_heads_are_read_in_place_with_the_gathers_bits(engine, monkeypatch) -> None:
    live = LiveAdapters(engine)
    weights = [random_adapter(f"a{i}", engine, m=1 + i % 2, classes=3 + i) for i in range(6)]
    live.replace_all(weights)
    x = images(engine, batch=3)
    gathered = heads_gathered(monkeypatch)
    in_place = engine(x, live.current)
    assert gathered == []  # no copy of any head
    monkeypatch.setattr(
        PassPlan, "head_run", property(lambda plan: None)
    )  # as a scattered plan or a captured pass
    monkeypatch.setattr(planned, "SHARED_HEAD_BYTES", 1)  # and in chunks of one row: any split
    gathered_logits = engine(x, live.current)
    assert gathered  # the gather did run
    _, reference = DenseMemoryViT(engine.base, weights)(x)
    for w in weights:
        assert torch.equal(in_place.adapters[w.name], gathered_logits.adapters[w.name])
        assert max_diff(in_place.adapters[w.name], reference[w.name]) <= TOL


def test_a_captured_pass_never_reads_the_run(engine, monkeypatch) -> None:
    """A graph would bake the run's first slot in: graphed passes gather, whatever the slots."""
    seen: list[int | None] = []
    forward = planned.planned_forward

    def spy(*args, **kwargs):
        seen.append(kwargs.get("head_run"))
        return forward(*args, **kwargs)

    monkeypatch.setattr("memvit.memory_core.engine.slot_passes.planned_forward", spy)
    live = LiveAdapters(engine)
    live.replace_all(random_adapter(f"a{i}", engine) for i in range(3))
    x = images(engine, batch=2)
    engine(x, live.current)
    monkeypatch.setattr(type(engine), "graphed", property(lambda self: True))
    plan = plan_pass(live.current, engine.slots, None, 2)
    engine._device_pass(x, plan.tensors(engine.device), plan, "merged")
    assert seen[0] is not None and seen[-1] is None
