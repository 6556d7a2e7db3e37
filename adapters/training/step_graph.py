"""A training step's pass forward and back to the adapters' stack, as one CUDA graph on CUDA.

A step's adapters are prepared and stacked from their live parameters (``MemoryViT.prepare``, what
serving runs); then the batch goes through every block, the base rows without autograd and the
class-token rows with it (the split path, docs/design.md §2.3; from an activation cache, the
class-token rows alone through the written-out block, §2.9), and back. Preparing is a few dozen
small operations; the pass and its way back are some 15 operations per block for the base and 60
for the class tokens, each a kernel launch that a GPU waits for when the batch is small (DeiT-Tiny
at batch 64: a few microseconds of work each). So the step is cut at the stack:

1. eagerly, the adapters are prepared and stacked (the autograd graph back to the parameters kept);
2. the stack's tensors are copied into static buffers, those that require grad into static leaves;
3. a CUDA graph, captured once, runs the pass from the static stack and the batch (images or cached
   activations), the losses, and ``autograd.grad`` of their sum with respect to the leaves: one
   launch for the whole pass, base included;
4. eagerly, those gradients flow from the stack's own tensors back through the preparation to the
   parameters (``torch.autograd.backward``), and the joint update (update.py) steps them.

By the chain rule the parameters get the gradients the uncut step gives them. Where the graph
cannot be used (the CPU; ``graphs`` off; a base whose pass reads a parameter otherwise than through
the stack, checked on the first step) the same cut runs eagerly, or (the last case) the step is not
cut at all. Capturing needs a pass without host synchronisation: the stack's heads are applied one
by one (``AdapterStack.apply_heads`` reads its head groups' members back to the host), which inside
a graph costs no launches. ``precision`` "bfloat16" runs the pass from images under autocast
(device.py); parameters, leaves, gradients and the update stay float32.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from memvit.memory_core import AdapterSet, MemoryViT
from memvit.memory_core.stored.cached import CachedBatch

from .base_pass import CAPTURE_MODE
from .device import autocast

log = logging.getLogger(__name__)

WARM_UP = 2  # eager runs of the captured function before capture (lazy state, allocator, cuBLAS)


def tensors_of(obj: Any, out: dict[int, Tensor] | None = None) -> dict[int, Tensor]:
    """Every tensor in a stack (dataclasses, tuples), once each, by identity, in a fixed order."""
    out = {} if out is None else out
    if isinstance(obj, Tensor):
        out.setdefault(id(obj), obj)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            tensors_of(getattr(obj, f.name), out)
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            tensors_of(item, out)
    return out


def replaced(obj: Any, by: dict[int, Tensor]) -> Any:
    """``obj`` with each tensor t replaced by ``by[id(t)]``."""
    if isinstance(obj, Tensor):
        return by[id(obj)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(
            obj, **{f.name: replaced(getattr(obj, f.name), by) for f in dataclasses.fields(obj) if f.init}
        )
    if isinstance(obj, (tuple, list)):
        return type(obj)(replaced(item, by) for item in obj)
    return obj


class StepGraph:
    """Steps 2-4 above for one run (its stack's layout and its batches' shape are the same every step)."""

    def __init__(
        self, engine: MemoryViT, names: list[str], precision: str = "float32", *, graphs: bool = True
    ) -> None:
        self.engine, self.names, self.precision = engine, names, precision
        self.graphs = graphs and engine.device.type == "cuda"
        self.cut: bool | None = None  # None: not checked yet; False: this base is not cut (see above)
        self.failed: str | None = None  # why capturing failed, if it did
        self._buffers: list[Tensor] = []  # static copies of the stack's tensors, leaves where trained
        self._set: AdapterSet | None = None
        self._inputs: list[Tensor] = []  # the batch's tensors, then the labels, when graphed
        self._graph: torch.cuda.CUDAGraph | None = None
        self._outputs: tuple | None = None
        self._runs = 0

    @property
    def graphed(self) -> bool:
        return self._graph is not None

    def _forward(self, inputs: list[Tensor], store: str | None):
        """The pass from the static stack: images (``store`` None) or a cached batch's tensors."""
        assert self._set is not None
        if store is not None:
            return self.engine(CachedBatch(store, *inputs), self._set)
        with autocast(inputs[0].device, self.precision):
            return self.engine(inputs[0], self._set)

    def _path(self, inputs: list[Tensor], labels: Tensor, store: str | None) -> tuple:
        """The pass, the losses (K,), hits (K,) and the leaves' gradients."""
        out = self._forward(inputs, store)
        z = torch.stack([out.adapters[name] for name in self.names]).float()  # (K, B, C)
        K, B, C = z.shape
        losses = F.cross_entropy(z.view(K * B, C), labels.repeat(K), reduction="none").view(K, B).mean(1)
        hits = (z.detach().argmax(-1) == labels).sum(-1)
        leaves = [b for b in self._buffers if b.requires_grad]
        grads = torch.autograd.grad(losses.sum(), leaves, allow_unused=True)
        return losses.detach(), hits, grads

    def __call__(
        self, adapter_set: AdapterSet, batch: Tensor | CachedBatch, labels: Tensor, params: list[Tensor]
    ) -> tuple[Tensor, Tensor] | None:
        """Gradients into ``params`` (by way of the stack) and the step's (losses, hits); None when
        this base is not cut (then the caller runs the uncut step)."""
        if isinstance(batch, CachedBatch):
            inputs, store = [batch.layers, batch.base_logits], batch.store
        else:
            inputs, store = [batch], None
        stack = adapter_set.stack
        found = list(tensors_of(stack).values())
        if self._set is None:
            self._buffers = [torch.empty_like(t).requires_grad_(t.requires_grad) for t in found]
            static = replaced(stack, {id(t): b for t, b in zip(found, self._buffers, strict=True)})
            self._set = AdapterSet(adapter_set.adapters)
            self._set._stack = dataclasses.replace(static, head_groups=())  # no host read (above)
        with torch.no_grad():
            for buffer, t in zip(self._buffers, found, strict=True):
                buffer.copy_(t)
        if self.cut is None and not self._check(inputs, store, params):
            return None
        if self.cut is False:
            return None
        outputs = self._run(inputs, labels, store)
        losses, hits, grads = outputs
        pairs = [
            (t, g) for t, g in zip((t for t in found if t.requires_grad), grads, strict=True) if g is not None
        ]
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        return losses.clone(), hits.clone()

    def _check(self, inputs: list[Tensor], store: str | None, params: list[Tensor]) -> bool:
        """Whether the pass reaches the parameters only through the stack (once, eagerly)."""
        out = self._forward(inputs, store)
        total = sum(out.adapters[name].float().sum() for name in self.names)
        direct = torch.autograd.grad(total, params, allow_unused=True)
        self.cut = all(g is None for g in direct)
        if not self.cut:
            log.info("the pass reads parameters outside the adapters' stack: the step is not cut")
        return self.cut

    def _run(self, inputs: list[Tensor], labels: Tensor, store: str | None) -> tuple:
        if not self.graphs or self.failed is not None:
            return self._path(inputs, labels, store)
        if self._graph is None:
            if self._runs < WARM_UP:  # eager, as the capture's warm-up: no side effects but the grads
                self._runs += 1
                return self._path(inputs, labels, store)
            self._capture(inputs, labels, store)
            if self._graph is None:
                return self._path(inputs, labels, store)
        for static, t in zip(self._inputs, (*inputs, labels), strict=True):
            if static is not t:  # a batch read from a cache on the device may come as the same tensor
                static.copy_(t, non_blocking=True)
        self._graph.replay()
        assert self._outputs is not None
        return self._outputs

    def _capture(self, inputs: list[Tensor], labels: Tensor, store: str | None) -> None:
        self._inputs = [t.clone() for t in (*inputs, labels)]  # the graph's own: batches are copied in
        *static, static_labels = self._inputs
        fn: Callable[[], tuple] = lambda: self._path(static, static_labels, store)  # noqa: E731
        device = labels.device
        try:
            with torch.cuda.device(device):  # capture on the tensors' device, whichever is current
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):  # the last warm-up off the default stream
                    fn()
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, capture_error_mode=CAPTURE_MODE):
                    self._outputs = fn()
            self._graph = graph
            log.info("captured the step's pass as a CUDA graph")
        except RuntimeError as exc:
            self.failed = f"{type(exc).__name__}: {exc}"
            self._outputs = None
            torch.cuda.synchronize(device)
            log.warning("the step's pass runs eagerly: capturing it failed (%s)", self.failed)
