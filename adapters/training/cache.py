"""Activation caches: every image's base activations, computed once and memory-mapped from disk.

    cache = ActivationCache.open_or_build(CacheSpec(Path("cache/train")), engine, samples)
    batch = cache.batch([3, 17, 4], views=[0, 1, 0])  # a memory_core.CachedBatch

The base never sees adapter tokens, so what the adapters' class tokens read of it is fixed per image
(docs/design.md §2.9): training and evaluation can run the class-token path alone from a cache.

A cache is a directory: ``manifest.json`` (the key below, the shapes, "complete"), ``files.json`` (the
images, with size, mtime and label), ``activations.bin`` (N, V, *stored shape) in the chosen dtype
and ``base_logits.bin`` (N, V, C_0) float32. A cache whose key (cache_key.py: base, preprocessing,
images, settings) differs is refused with what changed, never used; ``rebuild`` replaces it. It is built
in a temp directory beside its place and renamed into it only once complete, so a killed build never
leaves a cache that looks whole, and the free disk space is checked before anything is written.
"""

from __future__ import annotations

import fcntl
import json
import logging
import mmap
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from memvit.memory_core import MemoryViT
from memvit.memory_core.stored.cached import CachedBatch, capture, stored_shape

from ..files import fsync_dir
from ..preprocess import decode_target, eval_transform
from .cache_key import DTYPES, CacheError, CacheSpec, cache_key, check_key, files, read_manifest
from .data import ImageDataset, Samples
from .device import pinning, to_device
from .mixed_pass import HeldBase
from .residency import all_resident

log = logging.getLogger(__name__)


class ActivationCache:
    """An open, complete cache: its arrays memory-mapped read-only."""

    def __init__(self, directory: Path, manifest: dict[str, Any]) -> None:
        self.directory, self.manifest = directory, manifest
        self.key: dict[str, Any] = manifest["key"]
        self.store, self.dtype = self.key["store"], self.key["dtype"]
        shape, logits_shape = tuple(manifest["shape"]), tuple(manifest["logits_shape"])
        # Mapped by hand (not np.memmap) to give the kernel read-ahead hints for each batch (``batch``).
        with open(directory / "activations.bin", "rb") as f:
            self.mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self.activations = np.frombuffer(self.mapping, DTYPES[self.dtype]).reshape(shape)
            self.base_logits = np.memmap(directory / "base_logits.bin", np.float32, "r", shape=logits_shape)
        except ValueError as exc:
            raise CacheError(f"{directory}: damaged ({exc}); rebuild it with --rebuild-cache") from None
        self._row_bytes = self.activations[0, 0].nbytes

    @classmethod
    def open(cls, directory: Path) -> ActivationCache:
        """The complete cache in ``directory`` as it is, unchecked (to read what a cache holds)."""
        return cls(directory, read_manifest(directory))

    def __len__(self) -> int:
        return self.activations.shape[0]

    @property
    def views(self) -> tuple[str, ...]:
        return tuple(self.key["views"])

    @property
    def bytes_per_image(self) -> int:
        """Bytes of one image's activations, all views (what streaming an epoch reads per image: / views)."""
        return self.activations[0].nbytes + self.base_logits[0].nbytes

    def describe(self) -> dict[str, Any]:
        """The settings a run trained with, for its bundles' ``training`` metadata."""
        return {
            "dtype": self.dtype,
            "store": self.store,
            "views": list(self.views),
            "bytes_per_image": self.bytes_per_image,
        }

    def batch(self, rows: Sequence[int], views: Sequence[int] | None = None) -> CachedBatch:
        """Images ``rows`` (each as view ``views[i]``, default the original) as one batch."""
        index = np.asarray(rows, dtype=np.int64)
        view = np.zeros_like(index) if views is None else np.asarray(views, dtype=np.int64)
        self._will_need(index * len(self.views) + view)
        layers = torch.from_numpy(self.activations[index, view])  # fancy indexing: a copy
        if self.dtype == "bfloat16":
            layers = layers.view(torch.bfloat16)
        return CachedBatch(self.store, layers, torch.from_numpy(np.array(self.base_logits[index, view])))

    def _will_need(self, rows: np.ndarray) -> None:
        """Ask the kernel to read these (image, view) rows now, all at once. Page faults alone read a
        cache that is not in memory at a fraction of the disk's speed: ~250 MB/s against ~1.8 GB/s
        with the hint, measured on a CIFAR-10 cache (docs/design.md §2.9). Rows already in memory
        get no hint: there it would only cost a system call (residency.py)."""
        if not hasattr(self.mapping, "madvise"):
            return
        address = self.activations.ctypes.data  # the mapping's first byte
        for row in rows.tolist():
            start = row * self._row_bytes
            aligned = start - start % mmap.PAGESIZE
            length = start + self._row_bytes - aligned
            if not all_resident(address + aligned, length):
                self._hint(aligned, length)

    def _hint(self, offset: int, length: int) -> None:
        self.mapping.madvise(mmap.MADV_WILLNEED, offset, length)

    @classmethod
    def open_or_build(
        cls,
        spec: CacheSpec,
        engine: MemoryViT,
        samples: Samples,
        *,
        decode: str = "exact",
        batch_size: int = 64,
        workers: int = 0,
        progress: bool = True,
    ) -> ActivationCache:
        """The cache at ``spec.directory`` if its key matches; built there if absent (or ``rebuild``);
        refused, saying what changed, if it holds another base, preprocessing, dataset or setting."""
        key = cache_key(engine, samples, spec, decode)
        directory = spec.directory
        if directory.exists() and not spec.rebuild:
            manifest = read_manifest(directory)
            check_key(directory, manifest, key, samples)
            log.info("activation cache %s: reusing %d images", directory, len(samples))
            return cls(directory, manifest)
        if directory.exists() and not _looks_like_cache(directory):
            raise CacheError(f"{directory} exists and is not an activation cache: not replacing it")
        _build(directory, engine, samples, key, decode, batch_size, workers, progress)
        return cls(directory, read_manifest(directory))


def _looks_like_cache(directory: Path) -> bool:
    """What a rebuild may delete: an empty directory, or one holding a cache's files."""
    names = {p.name for p in directory.iterdir()}
    return not names or bool(names & {"manifest.json", "activations.bin"})


def _build(
    directory: Path,
    engine: MemoryViT,
    samples: Samples,
    key: dict[str, Any],
    decode: str,
    batch_size: int,
    workers: int,
    progress: bool,
) -> None:
    shape = (len(samples), len(key["views"]), *stored_shape(engine.spec, key["store"]))
    logits_shape = (len(samples), len(key["views"]), engine.spec.num_classes)
    itemsize = np.dtype(DTYPES[key["dtype"]]).itemsize
    needed = int(np.prod(shape)) * itemsize + int(np.prod(logits_shape)) * 4
    directory.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory.parent).free
    if needed + (64 << 20) > free:
        raise CacheError(
            f"activation cache {directory} needs {needed / 1e9:.2f} GB ({needed // len(samples):,} bytes per "
            f"image), only {free / 1e9:.2f} GB free there: free space, use --cache-dtype float16, "
            "fewer --cache-views, or another --cache directory"
        )
    temp = directory.parent / f".{directory.name}.building"
    with open(directory.parent / f".{directory.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CacheError(f"another process is building the activation cache {directory}") from None
        shutil.rmtree(temp, ignore_errors=True)  # what a killed build left
        temp.mkdir()
        log.info(
            "building activation cache %s: %d images x %d views, %.2f GB", directory, *shape[:2], needed / 1e9
        )
        _fill(temp, engine, samples, key, shape, logits_shape, decode, batch_size, workers, progress)
        (temp / "files.json").write_text(
            json.dumps({"classes": list(samples.classes), "files": files(samples)}), encoding="utf-8"
        )
        manifest = {"key": key, "shape": list(shape), "logits_shape": list(logits_shape), "complete": True}
        (temp / "manifest.json").write_text(json.dumps(manifest, indent=1), encoding="utf-8")  # written last
        fsync_dir(temp)
        if directory.exists():  # rebuilding: the old cache goes only once the new one is whole
            shutil.rmtree(directory)
        temp.rename(directory)
        fsync_dir(directory.parent)


def _fill(
    temp: Path,
    engine: MemoryViT,
    samples: Samples,
    key: dict[str, Any],
    shape: tuple[int, ...],
    logits_shape: tuple[int, ...],
    decode: str,
    batch_size: int,
    workers: int,
    progress: bool,
) -> None:
    """Run the base over every image (each view) and write what ``capture`` returns."""
    activations = np.memmap(temp / "activations.bin", DTYPES[key["dtype"]], "w+", shape=shape)
    logits = np.memmap(temp / "base_logits.bin", np.float32, "w+", shape=logits_shape)
    dtype = getattr(torch, key["dtype"])
    dataset = ImageDataset(samples, eval_transform(engine), shrink_to=decode_target(engine, decode))
    device = engine.device
    # Built by the engine where it is (the training device), in the run's precision; the images
    # decoded in worker processes and copied from pinned memory, as training reads them.
    loader = DataLoader(dataset, batch_size=batch_size, num_workers=workers, pin_memory=pinning(device))
    views = len(key["views"])
    precision = key.get("precision", "float32")  # bfloat16: the base held in it, as training runs it
    base = engine if precision == "float32" else HeldBase(engine, precision)
    start = 0
    # disable=None: a bar on a terminal only, never in captured or piped output.
    with tqdm(
        total=len(samples), desc="activation cache", unit="img", disable=None if progress else True
    ) as bar:
        for images, _ in loader:
            x = to_device(images, device)
            if views == 2:
                x = torch.cat([x, x.flip(-1)])  # the mirror image of the eval crop
            with torch.no_grad():
                base_logits, layers = capture(base, x, key["store"])
            n = len(images)
            layers = _per_image(layers.to(dtype), views)  # (n, V, ...)
            stored = layers.view(torch.uint16) if dtype == torch.bfloat16 else layers
            activations[start : start + n] = stored.numpy()
            logits[start : start + n] = _per_image(base_logits.float(), views).numpy()
            start += n
            bar.update(n)
    activations.flush()
    logits.flush()
    del activations, logits
    for name in ("activations.bin", "base_logits.bin"):
        with open(temp / name, "rb") as f:
            os.fsync(f.fileno())


def _per_image(t: torch.Tensor, views: int) -> torch.Tensor:
    """(V * n, ...) in view-major order, as captured -> (n, V, ...) on the CPU."""
    return t.cpu().unflatten(0, (views, -1)).transpose(0, 1)
