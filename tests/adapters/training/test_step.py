"""The trainer's step (adapters/training/step.py): the whole step as one function of the batch (one
CUDA graph on a GPU) gives the parameters, bit for bit, what the plain step gives them (memory_core's
stack, ``backward`` into ``.grad``, the joint update); the graph's route (rehearsed on the CPU) is
the same; nothing is read back to the host until ``flush``."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from memvit.adapters.training import TrainConfig
from memvit.adapters.training.step import TrainStep
from memvit.adapters.training.step_graph import WARM_UP
from memvit.adapters.training.update import JointUpdate
from memvit.adapters.training.variant import Variant
from memvit.memory_core import AdapterSet
from memvit.memory_core.stored.cached import CachedBatch, capture
from memvit.memory_core.stored.memory_projection import StackedProjection
from tests.conftest import images, tiny_engine

CLASSES = ("a", "b", "c")
LABELS = torch.tensor([0, 1, 2, 2, 1, 0])


def _variants(engine, x) -> list[Variant]:
    made = []
    for i, (m, norm) in enumerate(((0, "norm1"), (2, "norm1"), (3, "none"), (1, "norm1"))):
        config = TrainConfig(
            name=f"v{i}", train_dir="-", memory_tokens=m, memory_norm=norm, lr=0.05 * (i + 1), steps=20,
            weight_decay=0.01 * (i % 2), clip_grad=(0.05, 1.0, 10.0)[i % 3], head_only=i == 0,
        )  # fmt: skip
        v = Variant(engine, config, CLASSES, None, total=20, init_images=x[:2])
        with torch.no_grad():
            v.adapter.head.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(i))
        made.append(v)
    return made


class PlainStep:
    """The step written plainly: memory_core's own stack, ``backward`` into ``.grad``, the joint update."""

    def __init__(self, engine, variants, parent=None) -> None:
        self.engine, self.variants = engine, variants
        self.update = JointUpdate([v.optimizer for v in variants], [v.config.clip_grad for v in variants])
        self.pending = []

    def __call__(self, batch, labels) -> None:
        prepared = tuple(self.engine.prepare_many([v.adapter.live_weights() for v in self.variants]))
        adapter_set = AdapterSet(prepared)
        adapter_set._stack = dataclasses.replace(adapter_set.stack, head_groups=())  # heads one by one
        out = self.engine(batch, adapter_set)
        z = torch.stack([out.adapters[v.name] for v in self.variants]).float()
        K, B, C = z.shape
        losses = F.cross_entropy(z.view(K * B, C), labels.repeat(K), reduction="none").view(K, B).mean(1)
        for p in self.update.params:
            p.grad = None
        losses.sum().backward()
        self.update.load_rates()
        self.update([p.grad for p in self.update.params])
        for v in self.variants:
            v.schedule.step()
        self.pending.append(torch.stack([losses.detach(), (z.argmax(-1) == labels).sum(-1).float()]))

    flush = TrainStep.flush


def _run(make, variant="plain", steps=4, cached=False, batches=None) -> tuple[list[Variant], object]:
    engine = tiny_engine(variant).train()
    variants = _variants(engine, images(engine, batch=6))
    step = make(engine, variants)
    for i in range(steps):
        batch = images(engine, batch=(batches or [6] * steps)[i], seed=10 + i)
        if cached:  # the batch as an activation cache holds it
            logits, layers = capture(engine, batch, "inputs")
            batch = CachedBatch("inputs", layers, logits)
        step(batch, LABELS[: len(batch)])
    return variants, step


def _same(a: list[Variant], b: list[Variant]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.losses == y.losses and x.correct == y.correct and len(x.losses) > 0
        for p, q in zip(x.adapter.parameters(), y.adapter.parameters(), strict=True):
            assert torch.equal(p, q)
        for s, t in zip(x.optimizer.state.values(), y.optimizer.state.values(), strict=True):
            assert torch.equal(s["momentum_buffer"], t["momentum_buffer"])


@pytest.mark.parametrize("rehearse", [False, True], ids=["eager", "graph-route"])
@pytest.mark.parametrize("cached", [False, True], ids=["images", "cache"])
def test_the_step_is_the_plain_step_bit_for_bit(cached: bool, rehearse: bool) -> None:
    steps = WARM_UP + 3  # past the warm-up: the graph's route taken, then again with new batches
    mine, step = _run(lambda e, vs: TrainStep(e, vs, rehearse=rehearse), steps=steps, cached=cached)
    plain, reference = _run(PlainStep, steps=steps, cached=cached)
    assert step.path.static is rehearse and not step.path.graphed  # no CUDA here
    assert len(step.pending) == steps and all(not v.losses for v in mine)  # nothing read back yet
    step.flush()
    reference.flush()
    assert not step.pending
    _same(mine, plain)


@pytest.mark.parametrize("variant", ["qknorm_layerscale_prenorm", "registers"])
def test_other_bases_train_alike(variant: str) -> None:
    mine, step = _run(lambda e, vs: TrainStep(e, vs, rehearse=True), variant, steps=WARM_UP + 1)
    plain, reference = _run(PlainStep, variant, steps=WARM_UP + 1)
    step.flush()
    reference.flush()
    _same(mine, plain)


def test_a_pass_that_reads_parameters_outside_the_stack_trains_alike(monkeypatch) -> None:
    # From a cache without the stacked projection's rows, the written-out block reads each adapter's
    # memory parameters themselves (memory_core/stored/cached.py, _with_memory_rows): the step's
    # gradient goes to the parameters, so it reaches them by that route too.
    monkeypatch.setattr(StackedProjection, "project", lambda self, blocks, memory, norm: None)
    mine, step = _run(lambda e, vs: TrainStep(e, vs, rehearse=True), steps=WARM_UP + 1, cached=True)
    plain, reference = _run(PlainStep, steps=WARM_UP + 1, cached=True)
    step.flush()
    reference.flush()
    _same(mine, plain)


def test_a_batch_of_another_shape_runs_eagerly_beside_the_graph() -> None:
    batches = [6] * (WARM_UP + 1) + [4, 6]
    make = lambda e, vs: TrainStep(e, vs, rehearse=True)  # noqa: E731
    mine, step = _run(make, steps=len(batches), batches=batches)
    plain, reference = _run(PlainStep, steps=len(batches), batches=batches)
    assert step.path.static and step.path._inputs[0].shape[0] == 6  # the graph's inputs kept
    step.flush()
    reference.flush()
    _same(mine, plain)


def test_new_optimiser_state_is_taken_up_not_replayed_stale() -> None:
    """A resumed run loads new momentum buffers (and groups): the graph's route is left and taken
    again after a new warm-up, and the numbers stay the plain step's."""
    runs = []
    for make in (lambda e, vs: TrainStep(e, vs, rehearse=True), PlainStep):
        engine = tiny_engine().train()
        variants = _variants(engine, images(engine, batch=6))
        step = make(engine, variants)
        for i in range(2 * WARM_UP + 3):
            if i == WARM_UP + 1:
                for v in variants:
                    state = copy.deepcopy(v.optimizer.state_dict())
                    for buffer in state["state"].values():
                        buffer["momentum_buffer"].mul_(0.5)
                    v.optimizer.load_state_dict(state)
                if isinstance(step, TrainStep):
                    assert step.path.static
            step(images(engine, batch=6, seed=10 + i), LABELS)
            if isinstance(step, TrainStep) and i == WARM_UP + 1:
                assert not step.path.static  # dropped: warming up again
        step.flush()
        runs.append(variants)
        if isinstance(step, TrainStep):
            assert step.path.static
    _same(*runs)
