"""What a training step runs outside its CUDA graph (benchmarks/gpu/step_ops.py, on the graph's route
rehearsed on the CPU): a handful of operations, the same for one adapter and for a sweep of four,
and nothing that would make the host wait for a GPU, inside the graph or around it."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import profile

from benchmarks.gpu.step_ops import step_ops
from benchmarks.gpu.trace import SYNCING_OPS
from benchmarks.train_step_ops import variants
from memvit.adapters.training.step import TrainStep
from memvit.adapters.training.step_graph import GRAPH_MARK, WARM_UP
from memvit.memory_core.stored.cached import CachedBatch, capture
from tests.conftest import images, tiny_engine

# The batch and the labels copied into the graph's inputs, the learning rates from the host (a
# tensor made, then one copy), the measurements cloned out: 9 on the CPU; on CUDA the rates' tensor
# is made in pinned memory, an op or two more. At most this many per step:
OUTSIDE = 12


def _counts(n: int) -> dict:
    engine = tiny_engine().train()
    x = images(engine, batch=4)
    y = torch.tensor([0, 1, 2, 1])
    step = TrainStep(engine, variants(engine, x, n, classes=3), rehearse=True)
    for _ in range(WARM_UP + 1):
        step(x, y)
    assert step.path.static
    return step_ops(lambda: step(x, y), steps=2, cuda=False)


def test_a_step_runs_a_handful_of_operations_outside_its_graph_whatever_the_variants() -> None:
    one, four = _counts(1), _counts(4)
    for counts in (one, four):
        assert counts["outside the graph"] <= OUTSIDE
        assert counts["in the graph"] > 50 * counts["outside the graph"]  # the step is in the graph
        assert counts["host syncs"] == 0
    assert four["outside the graph"] == one["outside the graph"]
    assert four["in the graph"] > one["in the graph"]  # more variants: more work, all of it inside


@pytest.mark.parametrize("cached", [False, True], ids=["images", "cache"])
def test_nothing_in_the_graph_comes_from_the_host_or_goes_back_to_it(cached: bool) -> None:
    """Inside the captured function no tensor is made from host values (``torch.tensor``: a blocking
    copy on a GPU, and refused by a capture) and none is read back: the stack's index tensors and
    the update's layout are made once, on the first step."""
    engine = tiny_engine().train()
    x, y = images(engine, batch=4), torch.tensor([0, 1, 2, 1])
    batch = CachedBatch("inputs", *reversed(capture(engine, x, "inputs"))) if cached else x
    step = TrainStep(engine, variants(engine, x, 2, classes=3), rehearse=True)
    for _ in range(WARM_UP + 1):
        step(batch, y)
    with profile() as recorded:
        step(batch, y)
    events = recorded.events()
    marks = [e.time_range for e in events if e.name == GRAPH_MARK]
    inside = {e.name for e in events if any(m.start <= e.time_range.start <= m.end for m in marks)}
    assert len(marks) == 1 and {"aten::addmm", "aten::bmm"} & inside  # the pass is in there
    assert not inside & ({"aten::lift_fresh", "aten::lift"} | SYNCING_OPS)
