"""A run's training batches, on its device, and how long the step waited for each (``Feed``).

From images: decoded, cropped and flipped in worker processes (``device.image_loader``), pinned by
this thread when the device is CUDA, and copied without blocking the host. From an activation cache:
gathered on a reader thread where the cache is placed (cache_placement.py), copied likewise.
Either way the batches run from the current step to the end: a resumed run skips what it has
seen without loading any of it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

from memvit.memory_core import MemoryViT
from memvit.memory_core.stored.cached import CachedBatch

from ..preprocess import train_transform
from .cache_placement import PlacedCache
from .cache_stream import CachedStream
from .config import TrainConfig
from .data import ImageDataset, Samples, StreamSampler
from .device import image_loader, to_device

Batch = tuple[Tensor | CachedBatch, Tensor]


def batches(
    engine: MemoryViT,
    config: TrainConfig,
    samples: Samples,
    cache: PlacedCache | None,
    *,
    total: int,
    start: int,
    workers: int,
) -> Iterable[Batch]:
    """Steps ``start`` to ``total``'s (batch, labels) on the host (a cache's pinned for CUDA; images
    are pinned by ``Feed``)."""
    draws, first = total * config.batch_size, start * config.batch_size
    if cache is not None:
        return CachedStream(
            cache,
            samples,
            batch_size=config.batch_size,
            seed=config.seed,
            draws=draws,
            start=first,
            hflip=config.hflip,
        )
    transform = train_transform(engine, scale=config.crop_scale, hflip=config.hflip)
    dataset = ImageDataset(samples, transform, seed=config.seed)
    sampler = StreamSampler(len(dataset), config.seed, draws, start=first)
    # A few batches ahead per worker: decode times vary.
    return image_loader(
        dataset, batch_size=config.batch_size, workers=workers, sampler=sampler, prefetch_factor=4
    )


class Feed:
    """``batches`` moved to ``device``, with the seconds the caller waited for each (``waited``: the
    loader, and pinning a batch of images for a CUDA device, which is loading too)."""

    def __init__(self, source: Iterable[Batch], device: torch.device) -> None:
        self._batches: Iterator[Batch] = iter(source)
        self.device = device
        self.waited = 0.0  # seconds spent waiting for batches since the last ``take_waited``

    def __next__(self) -> Batch:
        tick = time.perf_counter()
        batch, labels = next(self._batches)
        moved = to_device(batch, self.device), to_device(labels, self.device)
        self.waited += time.perf_counter() - tick
        return moved

    def __iter__(self) -> Feed:
        return self

    def take_waited(self) -> float:
        waited, self.waited = self.waited, 0.0
        return waited
