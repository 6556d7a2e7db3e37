"""The trainer's step (adapters/training/step.py): cut at the stack (step_graph.py, one CUDA graph on
a GPU) it gives the parameters what the uncut step gives them; a base whose class-token path reads a
parameter outside the stack is not cut; nothing is read back to the host until ``flush``."""

from __future__ import annotations

import pytest
import torch

from memvit.adapters.training import TrainConfig
from memvit.adapters.training.step import TrainStep
from memvit.adapters.training.step_graph import replaced, tensors_of
from memvit.adapters.training.variant import Variant
from memvit.memory_core import AdapterSet
from memvit.memory_core.stored.cached import CachedBatch, capture
from memvit.memory_core.stored.memory_projection import StackedProjection
from tests.conftest import images, tiny_engine

CLASSES = ("a", "b", "c")


def _variants(engine, x, *, parent=None) -> list[Variant]:
    made = []
    for i, (m, norm) in enumerate(((0, "norm1"), (2, "norm1"), (3, "none"))):
        config = TrainConfig(
            name=f"v{i}", train_dir="-", memory_tokens=m, memory_norm=norm, lr=0.05 * (i + 1), steps=20
        )
        v = Variant(engine, config, CLASSES, parent, total=20, init_images=x[:2])
        with torch.no_grad():
            v.adapter.head.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(i))
        made.append(v)
    return made


def _run(variant: str, cut: bool, steps: int = 4, cached: bool = False) -> tuple[list[Variant], TrainStep]:
    engine = tiny_engine(variant).train()
    x = images(engine, batch=6)
    variants = _variants(engine, x)
    step = TrainStep(engine, variants)
    if not cut:
        step.path.cut = False
    for i in range(steps):
        batch = images(engine, batch=6, seed=10 + i)
        if cached:  # the batch as an activation cache holds it
            logits, layers = capture(engine, batch, "inputs")
            batch = CachedBatch("inputs", layers, logits)
        step(batch, torch.tensor([0, 1, 2, 2, 1, 0]))
    return variants, step


@pytest.mark.parametrize("cached", [False, True], ids=["images", "cache"])
def test_the_cut_step_gives_the_parameters_what_the_uncut_step_gives(cached: bool) -> None:
    cut, cut_step = _run("plain", cut=True, cached=cached)
    whole, whole_step = _run("plain", cut=False, cached=cached)
    assert cut_step.path.cut is True and whole_step.path.cut is False
    assert len(cut_step.pending) == 4  # nothing read back yet
    cut_step.flush()
    whole_step.flush()
    assert not cut_step.pending
    for a, b in zip(cut, whole, strict=True):
        assert a.losses == pytest.approx(b.losses, abs=1e-6) and len(a.losses) == 4
        assert a.correct == b.correct
        for p, q in zip(a.adapter.parameters(), b.adapter.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", ["qknorm_layerscale_prenorm", "registers"])
def test_other_bases_are_cut_and_train_alike(variant: str) -> None:
    cut, step = _run(variant, cut=True, steps=2)
    whole, _ = _run(variant, cut=False, steps=2)
    assert step.path.cut is True
    for a, b in zip(cut, whole, strict=True):
        for p, q in zip(a.adapter.parameters(), b.adapter.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_a_path_that_reads_parameters_outside_the_stack_is_not_cut(monkeypatch) -> None:
    # From a cache without the stacked projection's rows, the written-out block reads each adapter's memory
    # parameters themselves (memory_core/stored/cached.py, _with_memory_rows): a cut would lose their
    # gradient, so the first step finds that and runs uncut, as it always did.
    monkeypatch.setattr(StackedProjection, "project", lambda self, blocks, memory, norm: None)
    cut, step = _run("plain", cut=True, steps=3, cached=True)
    whole, _ = _run("plain", cut=False, steps=3, cached=True)
    assert step.path.cut is False
    for a, b in zip(cut, whole, strict=True):
        assert a.adapter.memory.grad is not None or not a.adapter.memory.requires_grad
        for p, q in zip(a.adapter.parameters(), b.adapter.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_the_stacks_tensors_are_walked_once_each_and_replaced_in_place() -> None:
    engine = tiny_engine()
    x = images(engine, batch=2)
    prepared = engine.prepare_many([v.adapter.live_weights() for v in _variants(engine, x)])
    stack = AdapterSet(tuple(prepared)).stack
    found = tensors_of(stack)
    assert id(stack.layers[0].bias) in found and id(stack.layers[1].bias) in found
    assert stack.layers[0].bias is stack.layers[1].bias  # one tensor shared by every layer: one entry
    copies = {key: t.detach().clone() for key, t in found.items()}
    rebuilt = replaced(stack, copies)
    assert rebuilt.layers[0].bias is rebuilt.layers[1].bias is copies[id(stack.layers[0].bias)]
    assert torch.equal(rebuilt.cls, stack.cls) and not rebuilt.cls.requires_grad
