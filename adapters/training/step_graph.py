"""A whole training step as one CUDA graph on CUDA: ``StepGraph`` runs a step function, and replays it.

The step function (step.py's ``TrainStep._step``) takes the batch's tensors and the labels and does
all of a step on the device: it prepares and stacks the adapters from their live parameters, runs
the pass (images: the split path, base included; a cached batch: the class-token rows), the losses,
``autograd.grad`` back to the parameters and the joint update (update.py), and returns what the
step measured. Each of those is a kernel launch or several; on a GPU with a small base (DeiT-Tiny at
batch 64: a few microseconds of work each) the host's launches, not the device, set the step's
pace. So the function is captured once, after ``WARM_UP`` eager runs, and each later step is:

1. the batch copied into the graph's own input tensors (none when it already is one);
2. one ``replay``: the whole step, every variant, from a single launch;
3. the measurements cloned out of the graph's output (the next replay overwrites it).

What the function reads besides its inputs stays where the graph saw it: the parameters (updated in
place), the momentum buffers, the learning-rate tensor the update reads (update.py refreshes it
before each step), the base's weights. ``key`` says what else a capture baked in (update.py's key:
momentum, decay, the buffers' identity); when it changes the graph is dropped and captured again
after new warm-ups. A batch of another shape runs eagerly. Where no graph can be used (the CPU,
``graphs`` off, a failed capture) the same function runs eagerly, every step.

``rehearse`` runs the graph's route without a graph, for the CPU: static inputs copied in, the
function called on them, its output cloned. The tests use it to check that route's data flow, and
the operation counts use it to see, on a CPU, what a GPU step runs outside its graph
(benchmarks/train_step_ops.py): the function runs inside a ``record_function(GRAPH_MARK)``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable

import torch
from torch import Tensor
from torch.profiler import record_function

from .base_pass import CAPTURE_MODE, after_failed_capture

log = logging.getLogger(__name__)

WARM_UP = 2  # eager runs before capture (lazy state, allocator, cuBLAS, the first step's buffers)
GRAPH_MARK = "memvit: the step's graph"  # the profiler's name for what the graph holds

Step = Callable[[list[Tensor]], Tensor]


class StepGraph:
    """A step function, eagerly or as one CUDA graph, with its warm-up, capture and fallback."""

    def __init__(
        self, fn: Step, device: torch.device, *, graphs: bool = True, rehearse: bool = False
    ) -> None:
        self.fn, self.device = fn, device
        self.graphs = graphs and device.type == "cuda"
        self.rehearse = rehearse and not self.graphs
        self.failed: str | None = None  # why capturing failed, if it did
        self._inputs: list[Tensor] = []  # the graph's own inputs (the batch is copied in)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._output: Tensor | None = None
        self._key: Hashable = None  # the key the graph was captured under
        self._runs = 0  # eager runs since the last capture was dropped

    @property
    def graphed(self) -> bool:
        return self._graph is not None

    @property
    def static(self) -> bool:
        """Whether steps go through static inputs: a captured graph, or its rehearsal."""
        return bool(self._inputs)

    def __call__(self, inputs: list[Tensor], key: Hashable = None, ready: bool = True) -> Tensor:
        """The step on ``inputs``: its output (fresh: the caller may keep it). ``key``: what the
        function bakes in besides its inputs; ``ready``: whether it may be captured now."""
        if self.static and key != self._key:
            self._drop()
        if self.static and self._fits(inputs):
            return self._replay(inputs)
        if (self.graphs or self.rehearse) and self.failed is None and not self.static:
            if self._runs >= WARM_UP and ready:
                self._capture(inputs, key)
                if self.static:
                    return self._replay(inputs)
            self._runs += 1
        return self._eager(inputs)

    def _eager(self, inputs: list[Tensor]) -> Tensor:
        if not self.graphs:
            with record_function(GRAPH_MARK):
                return self.fn(inputs)
        # Off the default stream, as a capture's warm-up should be: what is lazily set up per stream
        # (autograd's, cuBLAS's) is then ready for the capture's own stream.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), record_function(GRAPH_MARK):
            out = self.fn(inputs)
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(stream)
        out.record_stream(current)  # made on the side stream, read and freed on this one
        return out

    def _fits(self, inputs: list[Tensor]) -> bool:
        return all(
            s.shape == t.shape and s.dtype == t.dtype and s.device == t.device
            for s, t in zip(self._inputs, inputs, strict=True)
        )

    def _replay(self, inputs: list[Tensor]) -> Tensor:
        for static, t in zip(self._inputs, inputs, strict=True):
            if static is not t:  # a batch read from a cache on the device may come as the same tensor
                static.copy_(t, non_blocking=True)
        if self._graph is not None:
            self._graph.replay()
        else:  # the rehearsal: what the graph holds, eagerly
            with record_function(GRAPH_MARK):
                self._output = self.fn(self._inputs)
        assert self._output is not None
        return self._output.clone()

    def _drop(self) -> None:
        self._graph, self._output, self._inputs, self._runs = None, None, [], 0

    def _capture(self, inputs: list[Tensor], key: Hashable) -> None:
        self._inputs = [t.clone() for t in inputs]  # the graph's own: batches are copied in
        self._key = key
        if not self.graphs:
            return
        try:
            with torch.cuda.device(self.device):  # capture on the tensors' device, whichever is current
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, capture_error_mode=CAPTURE_MODE):
                    self._output = self.fn(self._inputs)
            self._graph = graph
            log.info("captured the training step as a CUDA graph")
        except RuntimeError as exc:  # torch.AcceleratorError (a failed capture's) is one too
            self.failed = f"{type(exc).__name__}: {exc}"
            self._drop()
            after_failed_capture(self.device, self.failed)
            log.warning("the training step runs eagerly: capturing it failed (%s)", self.failed)
