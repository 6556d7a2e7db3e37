"""Batches read from an activation cache: the training stream, and in-order passes for evaluation.

Training draws the same sample order as from images (``StreamSampler``: epoch after epoch of seeded
permutations, a resumed run starting where it stopped). Random crops cannot be cached, so the
augmentation is the choice of view: with an original and a mirrored view per image, each sample of
each epoch is the mirror with probability ``hflip``, drawn from (seed, epoch) so a run is reproducible.
The next batch is read on a thread while the current one trains, so a cache streaming from disk
overlaps its reads with the compute. The cache may be an ``ActivationCache`` or one placed for the
training device (cache_placement.py: then a batch is gathered in device or pinned memory).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from itertools import islice
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from memvit.memory_core.stored.cached import CachedBatch

from .cache import ActivationCache
from .data import Samples, StreamSampler

if TYPE_CHECKING:
    from .cache_placement import PlacedCache


def view_choices(seed: int, epoch: int, n: int, views: int, hflip: float) -> np.ndarray:
    """The view (0: original, 1: mirror) of each of ``n`` samples in ``epoch``."""
    if views == 1 or hflip <= 0:
        return np.zeros(n, dtype=np.int64)
    return (np.random.default_rng([seed, epoch]).random(n) < hflip).astype(np.int64)


def augmentation(views: tuple[str, ...] | None, hflip: float, crop_scale: tuple[float, float]) -> str:
    """What a run's images went through, in words (the CLI, the bundle's ``training`` and the report)."""
    if views is None:
        lo, hi = crop_scale
        flip = f" + hflip (p={hflip:g})" if hflip > 0 else ""
        return f"random-resized-crop (scale {lo:g}-{hi:g}){flip} (uncached)"
    used = views if hflip > 0 else views[:1]
    flip = f" (mirror with p={hflip:g})" if len(used) > 1 else ""
    return f"cached views: {'+'.join(used)}{flip}, centre crop"


class CachedStream:
    """Training batches (``CachedBatch``, labels) from ``cache``, draws ``start`` to ``draws``."""

    def __init__(
        self,
        cache: ActivationCache | PlacedCache,
        samples: Samples,
        *,
        batch_size: int,
        seed: int,
        draws: int,
        start: int = 0,
        hflip: float = 0.5,
    ) -> None:
        self.cache, self.batch_size, self.seed, self.hflip = cache, batch_size, seed, hflip
        self.labels = torch.tensor(samples.labels)
        self.sampler = StreamSampler(len(cache), seed, draws, start=start)
        self._views: dict[int, np.ndarray] = {}

    def _view(self, epoch: int) -> np.ndarray:
        if epoch not in self._views:
            n, views = len(self.cache), len(self.cache.views)
            self._views = {epoch: view_choices(self.seed, epoch, n, views, self.hflip)}
        return self._views[epoch]

    def _read(self, draws: list[int]) -> tuple[CachedBatch, Tensor]:
        n = len(self.cache)
        rows = [d % n for d in draws]
        views = [int(self._view(d // n)[d % n]) for d in draws]
        return self.cache.batch(rows, views), self.labels[rows]

    def __iter__(self) -> Iterator[tuple[CachedBatch, Tensor]]:
        draws = iter(self.sampler)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="cache-read") as reader:
            chunk = list(islice(draws, self.batch_size))
            pending = reader.submit(self._read, chunk) if chunk else None
            while pending is not None:
                batch = pending.result()
                chunk = list(islice(draws, self.batch_size))
                pending = reader.submit(self._read, chunk) if chunk else None
                yield batch


def in_order(
    cache: ActivationCache | PlacedCache, samples: Samples, batch_size: int
) -> Iterator[tuple[CachedBatch, Tensor]]:
    """Every image once, in order, as its original view (evaluation)."""
    labels = torch.tensor(samples.labels)
    for start in range(0, len(cache), batch_size):
        rows = list(range(start, min(start + batch_size, len(cache))))
        yield cache.batch(rows), labels[rows]
