"""What a training run sets up before its first step: the device, the data, the activation caches
(built on the training device, read from where they are fastest), the parent and the images that
memory is drawn from."""

from __future__ import annotations

import logging
import random

import torch

from memvit.memory_core import MemoryViT, PreparedAdapter

from ..bundle.attach import check_compatible
from ..bundle.reader import read_bundle
from ..preprocess import eval_transform
from .cache import ActivationCache
from .cache_placement import PlacedCache, place
from .config import TrainConfig, TrainingError
from .data import ImageDataset, Samples, scan_folder, split
from .device import default_workers, describe, resolve_device

log = logging.getLogger(__name__)


def device_for(engine: MemoryViT, config: TrainConfig) -> torch.device:
    """The run's device (``config.device``); the engine is moved there if it is elsewhere."""
    try:
        device = resolve_device(config.device)
    except ValueError as exc:
        raise TrainingError(str(exc)) from None
    if engine.device != device:
        log.info("moving the base from %s to %s", engine.device, describe(device))
        engine.to(device)
    return device


def workers_for(config: TrainConfig, device: torch.device) -> int:
    return default_workers(device) if config.workers is None else config.workers


def data(config: TrainConfig) -> tuple[Samples, Samples]:
    samples = scan_folder(config.train_dir)
    if config.val_dir:
        return samples, scan_folder(config.val_dir, classes=samples.classes)
    return split(samples, config.val_fraction, config.seed)


def caches(
    engine: MemoryViT,
    config: TrainConfig,
    samples: tuple[Samples, Samples],
    rebuild: bool,
    progress: bool,
    workers: int,
) -> tuple[PlacedCache | None, PlacedCache | None]:
    """The training and validation caches (``DIR/train``, ``DIR/val``), opened or built by the engine
    on its device in the run's precision, placed for reading (cache_placement.py); or none."""
    spec = config.cache_spec(rebuild=rebuild)
    if spec is None:
        return None, None
    if spec.views == 2 and config.hflip <= 0:
        log.warning("--cache-views 2 with hflip 0: the mirrored views are cached but never used")
    train, val = samples
    where = (config.cache_placement, engine.device)
    kw = {"batch_size": config.eval_batch_size, "workers": workers, "progress": progress}
    return (
        place(ActivationCache.open_or_build(spec.part("train"), engine, train, **kw), *where),
        place(ActivationCache.open_or_build(spec.part("val", views=1), engine, val, **kw), *where),
    )


def parent(engine: MemoryViT, config: TrainConfig, names: list[str]) -> PreparedAdapter | None:
    if config.parent is None:
        return None
    bundle = read_bundle(config.parent)
    check_compatible(bundle, engine)
    if bundle.weights.parent is not None:
        raise TrainingError(
            f"parent {bundle.name!r} itself extends {bundle.weights.parent!r}; "
            "training on top of a chain is not supported yet"
        )
    if bundle.name in names:
        raise TrainingError(f"the new adapter cannot have its parent's name {bundle.name!r}")
    return engine.prepare(bundle.weights)


def init_images(engine: MemoryViT, samples: Samples, seed: int, count: int = 16) -> torch.Tensor:
    """A seeded handful of training images, as the model sees them, to draw initial memory from."""
    indices = random.Random(seed).sample(range(len(samples)), min(count, len(samples)))
    dataset = ImageDataset(samples.subset(indices), eval_transform(engine))
    return torch.stack([dataset[i][0] for i in range(len(dataset))])
