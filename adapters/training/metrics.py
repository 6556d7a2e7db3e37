"""Top-1/top-5 accuracy through the fused model, per task, and the check that fusing changes nothing.

``evaluate_tasks`` runs each task's validation folder through ONE engine with every adapter loaded
and scores that task's logits; it then runs the same images through a set holding only that adapter
(and its ancestors) and checks that the predictions are the same: an adapter's accuracy must not
depend on which other adapters are served with it.

Both run on the engine's device. ``precision="bfloat16"`` runs the base's pass under bfloat16
autocast and the class-token path from its activations in float32, as training does (device.py,
base_pass.py); float32 scores through the served pass itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from memvit.memory_core import BASE_TASK, AdapterSet, AdapterWeights, LiveAdapters, MemoryViT, PreparedAdapter
from memvit.memory_core.stored.cached import CachedBatch

from ..preprocess import Transform, decode_target, eval_transform
from .base_pass import BasePass
from .cache import ActivationCache
from .cache_key import CacheSpec
from .cache_stream import in_order
from .data import DataError, ImageDataset, Samples, scan_folder
from .device import image_loader, to_device

if TYPE_CHECKING:
    from .cache_placement import PlacedCache


class LabelMatchError(DataError):
    """A validation folder's class matches no label, or several, of its task's head."""

    def __init__(self, task: str, folder_class: str, matches: int) -> None:
        super().__init__(
            f"{task}: folder class {folder_class!r} matches {matches} of the task's labels, expected 1"
        )
        self.task, self.folder_class, self.matches = task, folder_class, matches


@dataclass(frozen=True)
class Accuracy:
    top1: float
    top5: float
    images: int


@dataclass(frozen=True)
class TaskReport:
    task: str
    fused: Accuracy
    alone: Accuracy | None  # None for the base task (it is never affected by adapters)
    max_logit_diff: float  # fused vs alone
    same_predictions: bool

    @property
    def unchanged(self) -> bool:
        return self.same_predictions and (self.alone is None or self.alone.top1 == self.fused.top1)


def _count(logits: torch.Tensor, labels: torch.Tensor) -> tuple[int, int]:
    k = min(5, logits.shape[-1])
    top = logits.topk(k, dim=-1).indices
    return int((top[:, 0] == labels).sum()), int((top == labels[:, None]).any(-1).sum())


def _batches(
    samples: Samples,
    transform: Transform,
    batch_size: int,
    workers: int,
    shrink_to: int | None = None,
    cache: ActivationCache | PlacedCache | None = None,
    *,
    engine: MemoryViT,
    precision: str = "float32",
) -> Iterator[tuple[torch.Tensor | CachedBatch, torch.Tensor]]:
    """(images or cached activations, labels) of every sample once, in order, on the engine's device;
    in a precision other than float32 the images come as the base's activations (``BasePass``)."""
    device = engine.device
    if cache is not None:
        source: Iterable = in_order(cache, samples, batch_size)
    else:
        dataset = ImageDataset(samples, transform, shrink_to=shrink_to)
        source = image_loader(dataset, batch_size=batch_size, workers=workers)  # pinned by to_device
    base_pass = None if cache is not None or precision == "float32" else BasePass(engine, precision)
    for batch, labels in source:
        batch = to_device(batch, device)
        yield (batch if base_pass is None else base_pass(batch)), to_device(labels, device)


@torch.inference_mode()
def evaluate_many(
    engine: MemoryViT,
    weights: Sequence[AdapterWeights],
    samples: Samples,
    transform: Transform,
    *,
    batch_size: int = 64,
    workers: int = 0,
    parent: PreparedAdapter | None = None,
    cache: ActivationCache | PlacedCache | None = None,
    precision: str = "float32",
) -> list[Accuracy]:
    """Accuracy of each adapter (all sharing ``parent``, if any) on the same labelled samples.

    One fused pass per batch scores them all: the images are decoded and the base runs once; with
    ``cache`` (the samples' activation cache), neither: the class-token path reads the cache.
    """
    prepared = tuple(engine.prepare_many(list(weights)))
    adapter_set = AdapterSet(((parent,) if parent else ()) + prepared)
    counts = [[0, 0] for _ in weights]
    for images, labels in _batches(
        samples, transform, batch_size, workers, cache=cache, engine=engine, precision=precision
    ):
        out = engine(images, adapter_set)
        for count, w in zip(counts, weights, strict=True):
            c1, c5 = _count(out.adapters[w.name], labels)
            count[0], count[1] = count[0] + c1, count[1] + c5
    return [Accuracy(c1 / len(samples), c5 / len(samples), len(samples)) for c1, c5 in counts]


def _label_map(task: str, samples: Samples, labels: Sequence[str]) -> torch.Tensor:
    """Folder class index -> the task head's row, matching folder names to label names.

    A label matches a folder if it equals it or starts with it and a space (ImageNet's
    "n01440764 tench, Tinca tinca" matches folder "n01440764").
    """
    rows = []
    for name in samples.classes:
        hits = [i for i, label in enumerate(labels) if label == name or label.startswith(name + " ")]
        if len(hits) != 1:
            raise LabelMatchError(task, name, len(hits))
        rows.append(hits[0])
    return torch.tensor(rows)


@torch.inference_mode()
def evaluate_tasks(
    live: LiveAdapters,
    val_dirs: dict[str, str | Path],
    *,
    batch_size: int = 64,
    workers: int = 0,
    limit: int | None = None,
    decode: str = "exact",
    cache: CacheSpec | None = None,
    precision: str = "float32",
) -> list[TaskReport]:
    """Score each task ("base" or an adapter name) on its folder, through ``live``'s current set.

    ``decode``: "exact" or "fast", as the server's ``MEMVIT_DECODE`` (the same ``load_rgb``).
    ``cache``: read each task's images from the activation cache ``cache.directory/<task>`` (built if
    absent, refused if it was built from other images, base or preprocessing). ``precision``: of the
    base's pass (module docstring)."""
    engine, adapters = live.engine, live.current  # one snapshot for every task
    transform = eval_transform(engine)
    shrink_to = decode_target(engine, decode)
    reports = []
    for task, folder in val_dirs.items():
        if task == BASE_TASK:
            labels = engine.labels or tuple(f"class_{i}" for i in range(engine.spec.num_classes))
        else:
            labels = adapters[task].weights.labels or ()
        samples = (
            scan_folder(folder, classes=None, check_images=True) if limit is None else _limited(folder, limit)
        )
        rows = _label_map(task, samples, labels)
        alone_set = None
        if task != BASE_TASK:
            alone_set = AdapterSet(tuple(adapters[n] for n in reversed(adapters.lineage(task))))
        fused = [0, 0]
        alone = [0, 0]
        max_diff, same = 0.0, True
        task_cache = None
        if cache is not None:
            task_cache = ActivationCache.open_or_build(
                cache.part(task, views=1),
                engine,
                samples,
                decode=decode,
                batch_size=batch_size,
                workers=workers,
            )
        batches = _batches(
            samples, transform, batch_size, workers, shrink_to, task_cache, engine=engine, precision=precision
        )
        rows = rows.to(engine.device)
        for images, folder_labels in batches:
            target = rows[folder_labels]
            out = engine(images, adapters)
            logits = out.base if task == BASE_TASK else out.adapters[task]
            fused = [a + b for a, b in zip(fused, _count(logits, target), strict=True)]
            if alone_set is not None:
                solo = engine(images, alone_set).adapters[task]
                alone = [a + b for a, b in zip(alone, _count(solo, target), strict=True)]
                max_diff = max(max_diff, (solo - logits).abs().max().item())
                same = same and bool((solo.argmax(-1) == logits.argmax(-1)).all())
        n = len(samples)
        reports.append(
            TaskReport(
                task=task,
                fused=Accuracy(fused[0] / n, fused[1] / n, n),
                alone=None if alone_set is None else Accuracy(alone[0] / n, alone[1] / n, n),
                max_logit_diff=max_diff,
                same_predictions=same,
            )
        )
    return reports


def _limited(folder: str | Path, limit: int) -> Samples:
    """The first ``limit`` images per class (sorted), for quick evaluations."""
    samples = scan_folder(folder, check_images=False)
    keep, seen = [], {}
    for i, label in enumerate(samples.labels):
        if seen.get(label, 0) < limit:
            keep.append(i)
            seen[label] = seen.get(label, 0) + 1
    return samples.subset(keep)
