"""Planned passes as CUDA graphs: captured once per bucketed shape, replayed per batch.

A pass of a small model at a moderate batch is bound by the host: timm's DeiT-Tiny at batch 64
launches ~150 kernels whose launch time exceeds their run time on an H100. A CUDA graph replays
every kernel of a pass with one launch. What a graph reads is fixed at capture, so each graph owns
static inputs, the images and the packed plan (memory_core/routing/plan.py), copied in before each replay,
and reads the slot pools (memory_core/routing/slots.py) in place: a change of resident adapters writes a
slot and recaptures nothing. What varies between batches is bucketed so that few graphs serve all:

- the batch rounds up to 1, 2, 4, 8, then a multiple of 8 up to 64, of 32 up to 256, then of 64
  (padding images compute rows nobody reads; their results never touch the real ones: a row of
  every operation here depends on its own image alone);
- rows per image, lineage width and a routed plan's outputs round up to powers of two, and the
  outputs to at least the batch;
- the pools' generation: when they grow (more slots, longer memory, more classes), the graphs of
  older generations are dropped and captured again on first use, or, with the pools grown ahead
  (memory_core/routing/slots.py), before they are published, beside serving (graphs_beside.py).

On a server's serving threads no pass waits for a capture: a shape met for the first time runs
eagerly and is captured beside serving (``first_use_beside``, graphs_beside.py).

Per pass the host does four things and no more, whatever the tasks: copy the images into the
graph's static input, send the plan's host buffer into its static plan (one non-blocking copy, the
buffer reused once its event says the copy has run: memory_core/routing/staging.py), replay, and clone the
two outputs (the next replay overwrites them). No host sync, no event created, no allocation.

With ``engine.embed_ahead`` a planned pass is two graphs (``run_ahead``): the patch embedding's,
launched before the plan is made, so that the device embeds the images while the host plans (a
synced pass otherwise leaves the device idle for the whole plan), then the pass's from its tokens.

``MemoryViT`` uses this on CUDA unless ``engine.cuda_graphs`` is False. Graphs of one engine share a
memory pool and replay one at a time (a lock), each output copied out before the next replay.
``_record`` is the one CUDA-only step: benchmarks/host_path.py replaces it with a stand-in (the
replay a no-op) to measure the host path on a CPU.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .graphs_beside import BesideServing, DevicePass
from .plan import PassPlan, PlanTensors
from .staging import HostBuffers

log = logging.getLogger(__name__)

# A capture forbids only its own thread the calls that would break it. In the default "global" mode
# any thread's unsafe CUDA call (cudaMalloc, cudaHostAlloc: a server's decode threads, a loader's
# pin-memory thread) during a capture invalidates it and errors in that thread too; what a graph
# holds follows the stream it is captured on, not the thread (adapters/training captures so too).
CAPTURE_MODE = "thread_local"


def bucket_images(n: int) -> int:
    """The batch a graph is captured for: 1, 2, 4, 8, 16, 24, ..., 64, 96, ..., 256, 320, ..."""
    if n <= 8:
        return 1 << (n - 1).bit_length()
    step = 8 if n <= 64 else 32 if n <= 256 else 64
    return -(-n // step) * step


def bucket_rows(n: int) -> int:
    """Rows per image (and lineage width, outputs): the next power of two."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


@dataclass
class _Graph:
    replay: Callable[[], None]
    images: Tensor  # static input (B, C, H, W)
    plan: Tensor | None  # static input: the packed plan (int64)
    base: Tensor  # static outputs
    adapters: Tensor | None
    inputs: dict[int, Tensor] = field(default_factory=dict)  # a view of ``images`` per batch given
    holds: object = None  # the kept all-tasks plan (memory_core/routing/plan.py) ``plan`` holds, if any

    def input(self, n: int) -> Tensor:
        """The first ``n`` images of the static input (the view made once per size)."""
        if n == self.images.shape[0]:
            return self.images
        view = self.inputs.get(n)
        if view is None:
            view = self.inputs[n] = self.images[:n]
        return view


class GraphedPasses(BesideServing):
    """CUDA graphs of one engine's device pass, keyed by everything that fixes their shapes."""

    def __init__(self, *, max_graphs: int = 64, buffers: HostBuffers | None = None) -> None:
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._generation = 0
        self._pool = None  # the graphs' shared memory pool, made with the first
        self.buffers = buffers if buffers is not None else HostBuffers()  # the plans' host buffers
        self._lock = threading.Lock()
        self._local = threading.local()  # ``for_pending_pools``: this thread's, while in it
        self.captures = 0  # graphs captured for passes (a test and the benchmarks read it)
        self.captures_beside = 0  # graphs captured beside serving (graphs_beside.py)
        self.eager_passes = 0  # passes run eagerly while their shape's graph was captured beside
        self._deferred: set[tuple] = set()  # graphs whose capture is scheduled

    def __len__(self) -> int:
        return len(self._graphs)

    def run(
        self, x: Tensor, plan: PassPlan | None, key: tuple, device_pass: DevicePass
    ) -> tuple[Tensor, Tensor | None]:
        """Replay (capturing first if needed) ``device_pass`` of images ``x`` (B, C, H, W) on the device
        and a plan bucketed for graphs (``plan_pass(..., images=bucket_images, rows=bucket_rows,
        pad_outputs=True)``, its host buffer from ``self.buffers``); ``key`` names whatever else selects
        the device work (kernels, path). Returns copies of the outputs: base logits for the padded
        batch (its first B rows are the images'), and the adapter logits."""
        batch = bucket_images(x.shape[0]) if plan is None else plan.shape.images
        try:
            with self._lock:
                full_key, graph = self._find(key, x, plan, batch)
                if graph is None:
                    later = getattr(self._local, "later", None)
                    if later is not None:  # eagerly now, captured beside serving
                        self._defer(later, full_key, x, plan, batch, device_pass)
                        return self._eager(x, plan, batch, device_pass)
                    graph = self._new(full_key, key, x, plan, batch, device_pass)
                graph.input(x.shape[0]).copy_(x)
                return self._send_and_replay(graph, plan)
        finally:
            if plan is not None:  # not sent: failed before the copy (a sent buffer is left alone)
                self.buffers.release(plan.buffer)

    def run_ahead(
        self,
        x: Tensor,
        key: tuple,
        embed_pass: DevicePass,
        plan_now: Callable[[], PassPlan | None],
        tokens_pass: DevicePass,
    ) -> tuple[PassPlan | None, Tensor, Tensor | None]:
        """``run`` in two graphs: the patch embedding's (``embed_pass``), launched before the plan is
        made (``plan_now``), so that the device embeds while the host plans, then the pass's from
        those tokens (``tokens_pass``). Returns the plan and the outputs as ``run`` does."""
        plan = None
        try:
            with self._lock:  # held throughout: the tokens are the embedding graph's static output
                batch = bucket_images(x.shape[0])
                embed = self._graph(("embed", *key), x, None, batch, embed_pass)
                embed.input(x.shape[0]).copy_(x)
                embed.replay()
                plan = plan_now()
                tokens = embed.base  # (batch, T, D)
                full_key, graph = self._find(("tokens", *key), tokens, plan, batch)
                if graph is None:
                    later = getattr(self._local, "later", None)
                    if later is not None:  # eagerly now, from the embedding graph's tokens
                        self._defer(later, full_key, tokens, plan, batch, tokens_pass, embed)
                        return (plan, *self._eager(tokens, plan, batch, tokens_pass))
                    graph = self._new(full_key, ("tokens", *key), tokens, plan, batch, tokens_pass, tokens)
                return (plan, *self._send_and_replay(graph, plan))
        finally:
            if plan is not None:
                self.buffers.release(plan.buffer)

    def _graph(
        self, key: tuple, x: Tensor, plan: PassPlan | None, batch: int, device_pass: DevicePass, static=None
    ) -> _Graph:
        """The graph for ``key`` and this input and plan (captured if missing; call under the lock)."""
        full_key, graph = self._find(key, x, plan, batch)
        return graph if graph is not None else self._new(full_key, key, x, plan, batch, device_pass, static)

    def _find(self, key: tuple, x: Tensor, plan: PassPlan | None, batch: int) -> tuple[tuple, _Graph | None]:
        """The graph's full key, and the graph if captured (under the lock)."""
        shape = None if plan is None else plan.shape
        generation = None if plan is None else plan.generation  # a base-only pass reads no pool
        full_key = (key, tuple(x.shape[1:]), x.dtype, batch, shape, generation)
        # the pools grew (and this thread does not capture for pools grown ahead: graphs_beside.py)
        if generation is not None and generation > self._generation and not self._pending():
            self._drop(lambda k: k[-1] is not None and k[-1] < generation)
            self._generation = generation
        graph = self._graphs.get(full_key)
        if graph is not None:
            self._graphs.move_to_end(full_key)
        return full_key, graph

    def _new(self, full_key, key, x, plan, batch, device_pass, static=None) -> _Graph:
        if key[0] == "embed":  # new static tokens: the graphs reading the old ones go with them
            self._drop(lambda k: k[0] == ("tokens", *key[1:]) and k[3] == batch)
        return self._capture(full_key, x, plan, batch, device_pass, static, pending=self._pending())

    def _send_and_replay(self, graph: _Graph, plan: PassPlan | None) -> tuple[Tensor, Tensor | None]:
        """Send the plan into the graph's static plan (one non-blocking copy from its host buffer),
        replay, and copy the outputs out (the next replay overwrites them)."""
        if plan is not None and (plan.kept is None or graph.holds is not plan.kept):
            buffer = plan.buffer
            if buffer is None:  # a kept plan, or planned without this engine's buffers
                buffer = self.buffers.acquire(plan.host.size)
                buffer.array[:] = plan.host
            self.buffers.send(buffer, graph.plan)
            graph.holds = plan.kept
        graph.replay()
        base = graph.base.clone()
        return base, None if graph.adapters is None else graph.adapters.clone()

    def _capture(
        self,
        key: tuple,
        x: Tensor,
        plan: PassPlan | None,
        batch: int,
        device_pass: DevicePass,
        static=None,
        *,
        pending: bool = False,
        beside: bool = False,
        warmed: tuple | None = None,
    ) -> _Graph:
        """``warmed``: the static inputs (``_inputs``), already warmed up (``_warm_up``)."""
        while len(self._graphs) >= self.max_graphs and not pending:  # pending: the first served drops
            self._graphs.popitem(last=False)
        images, packed, tensors = warmed if warmed is not None else self._inputs(x, plan, batch, static)
        if warmed is None:
            self._warm_up(images, tensors, plan, device_pass)
        replay, base, adapters = self._record(images, tensors, plan, device_pass)
        if pending or beside:
            self.captures_beside += 1
        else:
            self.captures += 1
        log.info("captured a CUDA graph for %s (%d held)", key[3:5], len(self._graphs) + 1)
        captured = _Graph(replay, images, packed, base, adapters)
        captured.holds = None if plan is None else plan.kept  # captured with the plan copied in
        self._graphs[key] = captured
        return captured

    def _inputs(self, x: Tensor, plan: PassPlan | None, batch: int, static=None) -> tuple:
        """A graph's static inputs: its images (given: another graph's static output, or made here),
        and its packed plan with the views a pass reads."""
        images = (
            static if static is not None else torch.zeros(batch, *x.shape[1:], device=x.device, dtype=x.dtype)
        )
        packed = None if plan is None else torch.from_numpy(plan.host.copy()).to(x.device)
        return images, packed, None if plan is None else PlanTensors.unpack(packed, plan.shape)

    def _warm_up(
        self, images: Tensor, tensors: PlanTensors | None, plan: PassPlan | None, device_pass: DevicePass
    ) -> None:
        """Run the pass twice off the capture, on a side stream: Triton compiles, cuBLAS plans."""
        device = images.device
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                device_pass(images, tensors, plan)
        torch.cuda.current_stream(device).wait_stream(stream)

    def _record(
        self, images: Tensor, tensors: PlanTensors | None, plan: PassPlan | None, device_pass: DevicePass
    ) -> tuple[Callable[[], None], Tensor, Tensor | None]:
        """Capture ``device_pass`` over the static inputs (warmed up): its replay and its outputs."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode=CAPTURE_MODE):
            base, adapters = device_pass(images, tensors, plan)
        return graph.replay, base, adapters

    def _drop(self, stale: Callable[[tuple], bool]) -> None:
        for key in [k for k in self._graphs if stale(k)]:
            del self._graphs[key]

    def clear(self) -> None:
        with self._lock:
            self._graphs.clear()
