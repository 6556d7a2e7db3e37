"""Where a training run reads its activation cache from: device memory, pinned host memory or disk.

    placed = place(cache, "auto", device)      # an ActivationCache, read where it is fastest
    batch = placed.batch([3, 17, 4], views=[0, 1, 0])

- ``device``: the whole cache copied once into the training device's memory; a batch is one
  ``index_select`` there, and nothing crosses the bus while training (on the CPU: a copy in RAM).
- ``pinned``: copied once into page-locked host memory; a batch is gathered there on the reader
  thread straight into a pinned buffer and copied to the device without blocking (CUDA only).
- ``disk``: the memory-mapped cache as it is (cache.py: read-ahead per batch for rows not in memory);
  on CUDA each batch is pinned before its copy.
- ``auto``: device when the cache fits in half of the device's free memory, else pinned when it
  fits in half of the host's available memory, else disk. On the CPU the page cache already keeps a
  cache that fits in RAM, so auto is disk there.

Every placement returns the same numbers, bit for bit (tests/adapters/training/test_cache_placement.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from memvit.memory_core.stored.cached import CachedBatch

from .cache import ActivationCache
from .cache_key import CacheError
from .device import pinning

log = logging.getLogger(__name__)

CHUNK_BYTES = 256 << 20  # copied in pieces: a cache larger than RAM never needs a host-side copy whole


def available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where it cannot be read)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def choose(placement: str, nbytes: int, device: torch.device) -> str:
    """The placement ``auto`` stands for, for a cache of ``nbytes`` trained on ``device``."""
    if placement == "pinned" and device.type != "cuda":
        raise CacheError("cache placement 'pinned' needs a CUDA device (pinning is for copies to one)")
    if placement != "auto":
        return placement
    if device.type != "cuda":
        return "disk"
    free, _ = torch.cuda.mem_get_info(device)
    if nbytes <= free // 2:
        return "device"
    host = available_host_bytes()
    return "pinned" if host is not None and nbytes <= host // 2 else "disk"


def _torch(array: np.ndarray, dtype: str) -> Tensor:
    t = torch.from_numpy(np.array(array))  # a copy: the mapping is read-only
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


class PlacedCache:
    """An ``ActivationCache`` read from ``placement`` for ``device``: the same ``batch``, ``views``,
    ``len``, ``describe`` and attributes as the cache itself."""

    def __init__(self, cache: ActivationCache, placement: str, device: torch.device) -> None:
        self.cache, self.device = cache, device
        nbytes = cache.activations.nbytes + cache.base_logits.nbytes
        self.placement = choose(placement, nbytes, device)
        self._layers: Tensor | None = None  # (N * V, *stored shape), flattened over views
        self._logits: Tensor | None = None  # (N * V, C_0)
        if self.placement in ("device", "pinned"):
            target = device if self.placement == "device" else torch.device("cpu")
            pin = self.placement == "pinned"
            self._layers = self._copy(cache.activations, cache.dtype, target, pin)
            self._logits = self._copy(np.asarray(cache.base_logits), "float32", target, pin)
        log.info("activation cache %s read from %s (%.2f GB)", cache.directory, self.placement, nbytes / 1e9)

    @staticmethod
    def _copy(array: np.ndarray, dtype: str, target: torch.device, pin: bool) -> Tensor:
        """The array (N, V, ...) as one tensor (N * V, ...) on ``target``, copied a chunk at a time."""
        flat = array.reshape(-1, *array.shape[2:])
        like = _torch(flat[:1], dtype)
        out = torch.empty((flat.shape[0], *like.shape[1:]), dtype=like.dtype, device=target, pin_memory=pin)
        step = max(1, CHUNK_BYTES // max(1, flat[0].nbytes))
        for start in range(0, flat.shape[0], step):
            out[start : start + step].copy_(_torch(flat[start : start + step], dtype))
        return out

    def __len__(self) -> int:
        return len(self.cache)

    def __getattr__(self, name: str):
        """The rest is the cache's own (its directory, key, store, dtype, arrays, mapping)."""
        if name == "cache":  # not set yet: never recurse
            raise AttributeError(name)
        return getattr(self.cache, name)

    @property
    def views(self) -> tuple[str, ...]:
        return self.cache.views

    def describe(self) -> dict:
        return self.cache.describe()

    def batch(self, rows: Sequence[int], views: Sequence[int] | None = None) -> CachedBatch:
        """Images ``rows`` (each as view ``views[i]``, default the original) as one batch: on the
        device (placement device), or in host memory that is pinned when the device is CUDA."""
        if self._layers is None:  # disk
            batch = self.cache.batch(rows, views)
            if pinning(self.device):
                batch = CachedBatch(batch.store, batch.layers.pin_memory(), batch.base_logits.pin_memory())
            return batch
        V = len(self.views)
        index = torch.tensor(rows, dtype=torch.long) * V
        if views is not None:
            index += torch.tensor(views, dtype=torch.long)
        assert self._logits is not None
        if self.placement == "device":
            if pinning(self.device):  # the index's copy queues behind the device's work, not waits for it
                index = index.pin_memory().to(self.device, non_blocking=True)
            return CachedBatch(self.cache.store, self._layers[index], self._logits[index])
        layers = torch.empty((len(index), *self._layers.shape[1:]), dtype=self._layers.dtype, pin_memory=True)
        logits = torch.empty((len(index), self._logits.shape[1]), pin_memory=True)
        torch.index_select(self._layers, 0, index, out=layers)
        torch.index_select(self._logits, 0, index, out=logits)
        return CachedBatch(self.cache.store, layers, logits)


def place(cache: ActivationCache | None, placement: str, device: torch.device) -> PlacedCache | None:
    return None if cache is None else PlacedCache(cache, placement, device)
