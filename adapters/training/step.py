"""One optimiser step for every variant of a run, from one pass over a batch (``TrainStep``).

    step = TrainStep(engine, variants, parent, precision="float32")
    step(images, labels)          # or step(cached_batch, labels): from an activation cache
    step.flush()                  # the losses and hits of the steps so far, into each variant

A step is one function of the batch (``_step``), all of it on the device: the adapters prepared and
stacked from their live parameters (``MemoryViT.prepare_many``, what serving runs; the stack's
constant parts made once per run, stacking.py), the pass forward (from images: the base rows
without autograd and the class-token rows with it; in bfloat16 the base held in bfloat16 and the
class-token rows under autocast, mixed_pass.py; from a cache: the class-token rows alone), the
losses, ``autograd.grad`` of their sum back to the parameters and the joint update of every variant
(update.py). On CUDA that function is one CUDA graph (step_graph.py):
a step is the batch copied in, the learning rates copied in (the schedules set them on the host),
one replay and one small clone, however many variants train. No value comes back to the host
during a step: each step's losses and hits stay on the device (``pending``) until ``flush`` reads
them all in one copy, when a progress bar, a curve point, a checkpoint or the end needs them.

Rows never attend to each other, so the summed loss gives each adapter exactly the gradient it
would get alone; each has its own optimiser, learning rates, schedule and clipping, so each ends
where it would have ended alone (docs/design.md §2.8).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from memvit.memory_core import AdapterSet, MemoryViT, PreparedAdapter
from memvit.memory_core.stored.cached import CachedBatch

from .mixed_pass import MixedPass
from .stacking import StackLayout
from .step_graph import StepGraph
from .update import JointUpdate
from .variant import Variant


class TrainStep:
    """The step of a run: its variants, the base's pass and the joint update, and what the steps
    have measured and not yet read back (``pending``)."""

    def __init__(
        self,
        engine: MemoryViT,
        variants: Sequence[Variant],
        parent: PreparedAdapter | None = None,
        precision: str = "float32",
        *,
        graphs: bool = True,
        rehearse: bool = False,
    ) -> None:
        """``graphs``: the step as a CUDA graph on CUDA; ``rehearse``: the graph's route without one,
        on the CPU (step_graph.py)."""
        self.engine, self.variants, self.parent = engine, list(variants), parent
        self.precision = precision
        self.update = JointUpdate(
            [v.optimizer for v in self.variants], [v.config.clip_grad for v in self.variants]
        )
        self.path = StepGraph(self._step, engine.device, graphs=graphs, rehearse=rehearse)
        self.layout: StackLayout | None = None  # the stack's constants, made on the first step
        self.store: str | None = None  # the cached batches' store, or None for images
        self.pending: list[Tensor] = []  # per step: losses and hits (2, K), on the device
        self.mixed: MixedPass | None = None  # the pass from images in bfloat16, made on its first step

    def __call__(self, batch: Tensor | CachedBatch, labels: Tensor) -> None:
        """One step for every variant on ``batch`` (images or cached activations, on the engine's
        device) with ``labels`` (B,) there too."""
        if isinstance(batch, CachedBatch):
            inputs, self.store = [batch.layers, batch.base_logits, labels], batch.store
        else:
            inputs, self.store = [batch, labels], None
        self.update.load_rates()  # the schedules' rates for this step, into the device tensor
        key = (self.store, self.update.key())
        self.pending.append(self.path(inputs, key, ready=self.update.ready()))
        for v in self.variants:
            v.schedule.step()

    def _step(self, inputs: list[Tensor]) -> Tensor:
        """The whole step on the device (a CUDA graph's body): (2, K) each variant's loss and hits."""
        *batch, labels = inputs
        prepared = self.engine.prepare_many([v.adapter.live_weights() for v in self.variants])
        adapters = ((self.parent,) if self.parent else ()) + tuple(prepared)
        if self.layout is None or not self.layout.fits(adapters):
            self.layout = StackLayout.of(adapters)  # once per run: host values, so never in a capture
        adapter_set = AdapterSet(adapters)
        adapter_set._stack = self.layout.stack(adapters)
        if self.store is not None:
            logits = self.engine(CachedBatch(self.store, *batch), adapter_set).adapters
        elif self.precision == "float32":
            logits = self.engine(batch[0], adapter_set).adapters
        else:  # the base held in the run's dtype, the class-token rows under autocast (mixed_pass.py)
            if self.mixed is None:
                self.mixed = MixedPass(self.engine, self.precision)  # once: on an eager step
            logits = self.mixed(batch[0], adapter_set)
        z = torch.stack([logits[v.name] for v in self.variants]).float()  # (K, B, C)
        K, B, C = z.shape
        losses = F.cross_entropy(z.view(K * B, C), labels.repeat(K), reduction="none").view(K, B).mean(1)
        # Each loss depends on its own adapter's parameters only (rows never attend to each other),
        # so the sum's gradient for each adapter is that adapter's own loss gradient.
        grads = torch.autograd.grad(losses.sum(), self.update.params, allow_unused=True)
        self.update(grads)
        hits = (z.detach().argmax(-1) == labels).sum(-1)  # (K,)
        return torch.stack([losses.detach(), hits.float()])  # (2, K); hits exact below 2**24

    def flush(self) -> None:
        """Every pending step's losses and hits, read back in one copy, into the variants."""
        if not self.pending:
            return
        measured = torch.stack(self.pending).cpu()  # (steps, 2, K)
        self.pending.clear()
        losses, hits = measured[:, 0], measured[:, 1].sum(0)
        for k, v in enumerate(self.variants):
            v.losses.extend(losses[:, k].tolist())
            v.correct += int(hits[k])
