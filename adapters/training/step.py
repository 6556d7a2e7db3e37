"""One optimiser step for every variant of a run, from one pass over a batch (``TrainStep``).

    step = TrainStep(engine, variants, parent, precision="float32")
    step(images, labels)          # or step(cached_batch, labels): from an activation cache
    step.flush()                  # the losses and hits of the steps so far, into each variant

Order matters on a GPU, where the host queues work and the device runs it later:
1. the adapters are prepared and stacked first: building the stack copies small index tensors to
   the device, which waits for the device to finish what it was given (the previous step); here that
   wait costs the least, as nothing of this step is queued yet;
2. the pass forward (from images: the base rows without autograd and the class-token rows with it,
   under the run's precision; from a cache: the class-token rows alone), the losses and the way
   back to the adapters' stack are queued, on CUDA as one CUDA graph (step_graph.py);
3. the rest of the way back, through the preparation to the parameters, and the joint update
   (update.py) are queued while the device runs the graph.
No value comes back to the host during a step: each step's losses and hits stay on the device
(``pending``) until ``flush`` reads them all in one copy, when a progress bar, a curve point, a
checkpoint or the end needs them.

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

from .device import autocast
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
    ) -> None:
        self.engine, self.variants, self.parent = engine, list(variants), parent
        self.precision = precision
        self.path = StepGraph(engine, [v.name for v in self.variants], precision, graphs=graphs)
        self.params = [p for v in self.variants for p in v.params]
        self.update = JointUpdate()
        self.pending: list[tuple[Tensor, Tensor]] = []  # per step: losses (K,), hits (K,), on the device

    def __call__(self, batch: Tensor | CachedBatch, labels: Tensor) -> None:
        """One step for every variant on ``batch`` (images or cached activations, on the engine's
        device) with ``labels`` (B,) there too."""
        engine, variants = self.engine, self.variants
        prepared = tuple(engine.prepare_many([v.adapter.live_weights() for v in variants]))
        adapter_set = AdapterSet(((self.parent,) if self.parent else ()) + prepared)
        adapter_set.stack  # noqa: B018  # built now, before this step queues anything (see above)
        for v in variants:
            v.optimizer.zero_grad(set_to_none=True)
        # Each loss depends on its own adapter's parameters only (rows never attend to each other), so
        # the sum's gradient for each adapter is that adapter's own loss gradient.
        measured = self.path(adapter_set, batch, labels, self.params)
        if measured is None:  # this base's step is not cut (step_graph.py): the whole path eagerly
            measured = self._uncut(adapter_set, batch, labels)
        self.update([v.optimizer for v in variants], [v.config.clip_grad for v in variants])
        for v in variants:
            v.schedule.step()
        self.pending.append(measured)

    def _uncut(
        self, adapter_set: AdapterSet, batch: Tensor | CachedBatch, labels: Tensor
    ) -> tuple[Tensor, Tensor]:
        if isinstance(batch, CachedBatch):
            out = self.engine(batch, adapter_set)
        else:
            with autocast(batch.device, self.precision):
                out = self.engine(batch, adapter_set)
        logits = torch.stack([out.adapters[v.name] for v in self.variants]).float()  # (K, B, C)
        K, B, C = logits.shape
        per_image = F.cross_entropy(logits.view(K * B, C), labels.repeat(K), reduction="none")
        losses = per_image.view(K, B).mean(1)  # (K,) each variant's mean loss
        losses.sum().backward()
        return losses.detach(), (logits.detach().argmax(-1) == labels).sum(-1)

    def flush(self) -> None:
        """Every pending step's losses and hits, read back in one copy, into the variants."""
        if not self.pending:
            return
        losses = torch.stack([loss for loss, _ in self.pending]).cpu()  # (steps, K)
        hits = torch.stack([hit for _, hit in self.pending]).sum(0).cpu()  # (K,)
        self.pending.clear()
        for k, v in enumerate(self.variants):
            v.losses.extend(losses[:, k].tolist())
            v.correct += int(hits[k])
