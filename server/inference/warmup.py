"""The graphs a server will replay, captured before it takes traffic and again after the slot pools grow.

On CUDA each pass is a graph replay, and a graph is captured the first time its shape is met
(memory_core/routing/graphs.py): under load that is a request's pass stretched by a capture (three passes'
time), and a capture while other threads queue device work (the decoder's synchronisations, the
collector's) is what CUDA's capture mode forbids. So the engine loop captures every shape it expects
to meet before any of its threads run: at start-up, before ``/readyz`` says ready, and when the slot
pools have grown (their generation counts up and every graph of the old generation is dropped:
an adapter loaded past the pools' capacity, memory length or classes), with the loop's other stages
idle (server/inference/engine_loop.py).

The shapes: every batch bucket up to ``max_batch`` (1, 2, 4, 8, 16, 24, ...), each with
- the base alone (requests asking for no adapter);
- every resident adapter for every image (requests without ``tasks``, while the registry is small
  enough to allow them);
- one adapter per image, the same for all (a batch of one key's requests) and different ones (a
  routed batch), for each distinct (memory, classes) width among the resident adapters (a few).
A shape met later that is none of these is captured on first use: several tasks per image, or a
batch that mixes requests for every adapter with requests for one (its rows per image and outputs
take one of many bucketed values; warming them all would multiply the start-up by ~10).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence

import torch

from memvit.memory_core import AdapterSet, MemoryViT
from memvit.memory_core.routing.graphs import bucket_images
from memvit.memory_core.routing.slots import widths

log = logging.getLogger(__name__)
WIDTH_GROUPS = 4  # distinct (memory, classes) widths warmed; more are captured on first use

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
    first_two = [a.name for a in adapter_set.adapters[:2]]  # not ``names``: O(K) at every call
    out: list[tuple[int, Tasks, bool]] = []
    for b in batch_buckets(max_batch):
        out.append((b, None, False))  # the base alone
        if not len(adapter_set):
            continue
        if len(adapter_set) <= max_tasks:
            out.append((b, None, True))  # every adapter, every image
        for name in names:
            out.append((b, [(name,)] * b, True))  # shared: one adapter for the batch
            if b > 1 and len(adapter_set) > 1:  # routed: images asking for different adapters
                other = first_two[1] if first_two[0] == name else first_two[0]
                out.append((b, [(name,) if i % 2 else (other,) for i in range(b)], True))
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
