"""A run's stack layout (adapters/training/stacking.py) stacks its adapters exactly as memory_core's
``stack_adapters`` does, and its gradients reach the parameters alike, from constants made once."""

from __future__ import annotations

import pytest
import torch

from memvit.adapters.training import TrainableAdapter
from memvit.adapters.training.stacking import StackLayout
from memvit.memory_core import AdapterWeights
from memvit.memory_core.sets.stack import stack_adapters
from tests.conftest import tiny_engine


def _trainables(engine, parent=None) -> list[TrainableAdapter]:
    made = []
    for i, (m, norm) in enumerate(((0, "norm1"), (2, "norm1"), (3, "none"))):
        a = TrainableAdapter(
            engine, f"t{i}", num_classes=3 + i, memory_tokens=m, memory_norm=norm, parent=parent,
            generator=torch.Generator().manual_seed(i),
        )  # fmt: skip
        with torch.no_grad():
            a.head.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(10 + i))
        made.append(a)
    return made


def _adapters(engine, trainables, parent=None) -> tuple:
    prepared = tuple(engine.prepare_many([a.live_weights() for a in trainables]))
    return ((parent,) if parent is not None else ()) + prepared


def _fields(stack) -> list:
    layers = [(x.keys, x.values, x.bias, x.lineage, x.lineage_bias, x.inputs) for x in stack.layers]
    return [stack.cls, *(t for layer in layers for t in layer), *(t for head in stack.heads for t in head)]


@pytest.mark.parametrize("extension", [False, True], ids=["concatenation", "extension"])
def test_the_layouts_stack_is_memory_cores_stack_bit_for_bit(extension: bool) -> None:
    engine = tiny_engine()
    parent = None
    if extension:
        weights = AdapterWeights.initialise(
            "parent", engine.spec, num_memory=2, num_classes=3, cls_token=engine.base.cls_token,
            generator=torch.Generator().manual_seed(7),
        )  # fmt: skip
        parent = engine.prepare(weights)
    trainables = _trainables(engine, parent)
    layout = StackLayout.of(_adapters(engine, trainables, parent))
    grads = []
    for build in (stack_adapters, layout.stack):
        adapters = _adapters(engine, trainables, parent)  # prepared afresh, as every step does
        stack = build(adapters)
        assert not stack.head_groups
        found = _fields(stack)
        if grads:
            assert all((a is None) == (b is None) for a, b in zip(found, grads[0][0], strict=True))
            assert all(a is None or torch.equal(a, b) for a, b in zip(found, grads[0][0], strict=True))
        total = sum(
            (t.float() * (i + 1)).sum()
            for i, t in enumerate(found)
            if t is not None and t.is_floating_point()
        )
        params = [p for a in trainables for p in a.parameters() if p.requires_grad]
        grads.append((found, torch.autograd.grad(torch.nan_to_num(total, neginf=0.0), params)))
    for a, b in zip(grads[0][1], grads[1][1], strict=True):
        assert torch.equal(a, b)
    # The constants are the layout's own, made once: no tensor from the host on a later stack.
    again = layout.stack(_adapters(engine, trainables, parent))
    assert again.layers[0].lineage is layout.lineage and again.layers[-1].bias is layout.bias


def test_a_layout_refuses_adapters_of_another_layout() -> None:
    engine = tiny_engine()
    trainables = _trainables(engine)
    layout = StackLayout.of(_adapters(engine, trainables))
    assert layout.fits(_adapters(engine, trainables))
    assert not layout.fits(_adapters(engine, trainables[:2]))
    with pytest.raises(ValueError, match="layout"):
        layout.stack(_adapters(engine, trainables[::-1]))
