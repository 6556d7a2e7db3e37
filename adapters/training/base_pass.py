"""The frozen base's pass alone: images -> what the adapters' class tokens read of it.

``memory_core.stored.cached.capture`` is the pass that fills an activation cache: every layer's normed
input and the base logits, as one ``CachedBatch``; the class-token path then runs from it as from a
cache (``forward_cached``). ``BasePass`` runs it in a precision (device.py: in bfloat16, through the
base held in bfloat16 as a training step's base rows run, mixed_pass.py, its layers bfloat16 as a
bfloat16 cache keeps them) and, on CUDA, as a CUDA graph captured
once per batch shape and replayed: one launch instead of about 15 per block. Evaluation in bfloat16
scores through it (metrics.py): the base in bfloat16, the class-token path in float32 over its
activations. The graph's output tensors are reused by every replay, so a ``CachedBatch`` from here
is valid until the next call. On the CPU the same pass runs eagerly.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from memvit.memory_core import MemoryViT
from memvit.memory_core.stored.cached import CachedBatch, capture

from .device import PRECISIONS
from .mixed_pass import HeldBase

log = logging.getLogger(__name__)

STORE = "inputs"  # what the written-out class-token block reads (memory_core/stored/cached_block.py)
# Only the capturing thread is held to capture's rules: while a graph is captured, the cache's reader
# thread gathers batches (and a caller's own threads may do CUDA work), and in the default "global"
# mode that would invalidate the capture (and poison that thread). What a graph holds follows the
# stream it is captured on, not the thread: the backward pass's kernels, launched by autograd's
# device thread on that stream, are captured all the same.
CAPTURE_MODE = "thread_local"


def after_failed_capture(device: torch.device, failed: str) -> None:
    """Wait for the device after a capture failed (``failed``: why), before running eagerly. A
    device that fails even this is broken, not uncapturable: raise, naming both failures."""
    try:
        torch.cuda.synchronize(device)
    except RuntimeError as exc:  # torch.AcceleratorError is a RuntimeError
        raise RuntimeError(f"a CUDA graph capture failed ({failed}), then the device: {exc}") from exc


class _Graph:
    """One captured base pass: a static input buffer, the graph, its static outputs."""

    def __init__(self, fn, x: Tensor) -> None:
        self.x = x.clone()
        with torch.cuda.device(x.device):  # capture on the tensors' device, whichever is current
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up off the default stream, as capture requires
                for _ in range(2):
                    fn(self.x)
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, capture_error_mode=CAPTURE_MODE):
                self.out = fn(self.x)

    def __call__(self, x: Tensor) -> tuple[Tensor, Tensor]:
        self.x.copy_(x, non_blocking=True)
        self.graph.replay()
        return self.out


class BasePass:
    """Images (B, C, H, W) on the engine's device -> ``CachedBatch`` of the base's activations, in
    the run's ``precision`` (device.py); graphed per batch shape on CUDA when ``graphs`` is on."""

    def __init__(self, engine: MemoryViT, precision: str = "float32", *, graphs: bool = True) -> None:
        self.engine, self.precision = engine, precision
        self.base = engine if precision == "float32" else HeldBase(engine, precision)
        self.graphs = graphs
        self._graphs: dict[tuple, _Graph] = {}
        self.failed: str | None = None  # why capturing failed, if it did (then the pass runs eagerly)

    @property
    def graphed(self) -> bool:
        return self.graphs and self.failed is None and self.engine.device.type == "cuda"

    def _eager(self, x: Tensor) -> tuple[Tensor, Tensor]:
        with torch.no_grad():
            logits, layers = capture(self.base, x, STORE)
        # In the pass's precision, as a cache in that dtype keeps them (the class-token path widens
        # them where it reads them).
        return logits, layers.to(PRECISIONS[self.precision])

    def __call__(self, x: Tensor) -> CachedBatch:
        if self.graphed:
            key = (tuple(x.shape), x.dtype, self.engine.dtype, self.engine.device)
            graph = self._graphs.get(key)
            if graph is None:
                graph = self._capture(key, x)
            if graph is not None:
                logits, layers = graph(x)
                return CachedBatch(STORE, layers, logits)
        logits, layers = self._eager(x)
        return CachedBatch(STORE, layers, logits)

    def _capture(self, key: tuple, x: Tensor) -> _Graph | None:
        try:
            graph = self._graphs[key] = _Graph(self._eager, x)
        except RuntimeError as exc:  # (AcceleratorError too) uncapturable: run it eagerly, say so once
            self.failed = f"{type(exc).__name__}: {exc}"
            log.warning("the base pass runs eagerly: capturing it as a CUDA graph failed (%s)", self.failed)
            after_failed_capture(x.device, self.failed)
            return None
        log.info("captured the base pass for batch shape %s as a CUDA graph", tuple(x.shape))
        return graph

    def clear(self) -> None:
        """Drop the captured graphs (their memory goes back to the allocator's pool)."""
        self._graphs.clear()
