"""The graphs a server will replay, captured before it takes traffic and again when the slot pools grow.

On CUDA each pass is a graph replay, and a graph is captured the first time its shape is met
(memory_core/routing/graphs.py): under load that is a request's pass stretched by a capture (three passes'
time). So the engine loop captures every shape it expects to meet (``PassGraphs``):

- at start-up, before any of its threads run and before ``/readyz`` says ready;
- when an install must grow the slot pools (an adapter loaded past their capacity, memory length
  or classes: their generation counts up, and a graph reads one generation's tensors), on the
  installing thread, before the grown pools are published (``LiveAdapters.on_growth``,
  ``AdapterSlots.grow_ahead``): the engine's stages go on replaying the old generation's graphs
  meanwhile, waiting at most one capture at a time (the graphs' lock), and only the requests that
  need the new adapters wait for the install, as they would anyway. CUDA graphs are captured in
  the thread-local mode (memory_core/routing/graphs.py), so the decode threads' and the collector's
  device work beside a capture does not break it;
- should that fail, by the batcher once it sees the pools grew, with the loop's other stages idle
  (server/inference/engine_loop.py), as before the growth ahead existed.

The shapes: every batch bucket up to ``max_batch`` (1, 2, 4, 8, 16, 24, ...), each with
- the base alone (requests asking for no adapter);
- every resident adapter for every image (requests without ``tasks``, while the registry is small
  enough to allow them);
- one adapter per image, the same for all (a batch of one key's requests) and different ones or
  none (a routed batch: its shape is that of its widest adapter), for each distinct (memory,
  classes) width among the resident adapters (a few).
A shape met later that is none of these runs eagerly, its graph captured on the ``engine-graphs``
thread beside serving (``PassGraphs.serving``), and replayed once captured: several tasks per image, or a
batch that mixes requests for every adapter with requests for one (its rows per image and outputs
take one of many bucketed values; warming them all would multiply the start-up by ~10).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager

import torch

from memvit.memory_core import AdapterSet, LiveAdapters, MemoryViT
from memvit.memory_core.routing.graphs import bucket_images
from memvit.memory_core.routing.slots import widths

from ..telemetry.os_names import os_named

log = logging.getLogger(__name__)
WIDTH_GROUPS = 4  # distinct (memory, classes) widths warmed; more are captured beside serving

Tasks = Sequence[Collection[str]] | None


def batch_buckets(max_batch: int) -> list[int]:
    return sorted({bucket_images(n) for n in range(1, max_batch + 1)})


def shapes(adapter_set: AdapterSet, max_batch: int, max_tasks: int) -> list[tuple[int, Tasks, bool]]:
    """(batch, per-image tasks, whether the pass reads the set) for every pass to capture."""
    groups: dict[tuple[int, int], str] = {}
    for adapter in adapter_set:
        key = widths(adapter.memory_keys.shape[2], adapter.head_weight.shape[0])
        if key not in groups and len(groups) < WIDTH_GROUPS:
            groups[key] = adapter.name
    names = list(groups.values())
    out: list[tuple[int, Tasks, bool]] = []
    for b in batch_buckets(max_batch):
        out.append((b, None, False))  # the base alone
        if not len(adapter_set):
            continue
        if len(adapter_set) <= max_tasks:
            out.append((b, None, True))  # every adapter, every image
        for name in names:
            out.append((b, [(name,)] * b, True))  # shared: one adapter for the batch
            if b > 1:  # routed: images asking for different adapters or none, as wide as ``name``
                out.append((b, [(name,) if i % 2 else () for i in range(b)], True))
    return out


def warm_up(engine: MemoryViT, adapter_set: AdapterSet, max_batch: int, max_tasks: int) -> int:
    """Run every pass of ``shapes`` once on blank images, so that its graph is captured (on CUDA
    with graphs on; elsewhere nothing is cached and nothing is run). Returns the passes run."""
    if not engine.graphed:
        return 0
    started = time.perf_counter()
    size = engine.data_config()["input_size"]
    planned = shapes(adapter_set, max_batch, max_tasks)
    with torch.inference_mode():
        for batch, tasks, reads_set in planned:
            x = torch.zeros(batch, *size, device=engine.device, dtype=engine.dtype)
            engine(x, adapter_set if reads_set else None, tasks=tasks)
        # (a stand-in's graphs run on the CPU: tests/server/inference/test_warmup.py)
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
    log.info(
        "captured the graphs of %d passes (batches up to %d, %d adapters resident) in %.1f s",
        len(planned), max_batch, len(adapter_set), time.perf_counter() - started,
    )  # fmt: skip
    return len(planned)


class PassGraphs:
    """When the graphs of ``warm`` (``warm_up`` for a server's settings) are captured for ``live``'s
    engine: ``start`` (the live set now); then, ``beside`` serving, every growth of the slot pools
    on the installing thread, and every shape a pass meets first on the ``engine-graphs`` thread
    while that pass runs eagerly (``serving``, around each launch); and ``capture`` again whenever
    ``stale`` (a growth the hook did not cover), on the batcher with the other stages idle."""

    def __init__(self, live: LiveAdapters, warm: Callable[[AdapterSet], int], *, beside: bool = True) -> None:
        """``beside``: capture beside serving (False: a shape first met is captured by its pass, and a
        growth's graphs by the batcher, ``stale``)."""
        self.live, self.warm, self.beside = live, warm, beside
        self.warmed: int | None = None  # the slot pools' generation the graphs were captured for
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()  # captures for ``engine-graphs``
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.capture()
        if self.beside and self.live.engine.graphed:  # (a CPU's passes capture nothing)
            self.live.on_growth = self._grown
            self._thread = threading.Thread(
                target=os_named("engine-graphs", self._capturing), name="engine-graphs", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        if self.live.on_growth == self._grown:
            self.live.on_growth = None
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def serving(self) -> AbstractContextManager:
        """Around a batch's launch: a shape without a graph runs eagerly, captured beside serving."""
        engine = self.live.engine
        if self._thread is None or not engine.graphed:
            return contextlib.nullcontext()
        return engine.first_use_beside(self._jobs.put)

    def _capturing(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except Exception:  # its shape runs eagerly until a later capture succeeds
                log.exception("capturing a pass's graph beside serving failed")

    def stale(self) -> bool:
        """Whether the published pools are newer than the graphs captured for them (the pending
        ones' generation counts as captured while they wait to be published)."""
        return self.warmed is None or self.live.engine.slots.generation > self.warmed

    def capture(self) -> None:
        """Every expected pass's graph for the live set (any other shape: when first met)."""
        generation = self.live.engine.slots.generation
        try:
            self.warm(self.live.current)
        except Exception:
            log.exception("capturing the passes' graphs failed")
        self.warmed = generation

    def _grown(self, adapter_set: AdapterSet) -> None:
        """``LiveAdapters.on_growth``: on the installing thread, whose passes read the grown pools."""
        generation = self.live.engine.slots.generation  # the pending pools' (this thread grew them)
        started, captures = time.perf_counter(), []
        # Each pass eagerly, its capture after: the capture's warm-up passes then run outside the
        # graphs' lock, which the serving passes wait for (memory_core/routing/graphs_beside.py).
        with self.live.engine.first_use_beside(captures.append):
            self.warm(adapter_set)  # raises: the batcher captures them (``stale``)
        for capture in captures:
            capture()
        self.warmed = generation
        log.info(
            "captured the passes of the grown slot pools (generation %d) beside serving in %.2f s",
            generation, time.perf_counter() - started,
        )  # fmt: skip
