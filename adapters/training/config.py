"""What defines a training run (``TrainConfig``), and which of it several runs can share.

Several adapters for one base train in ONE pass over the data (``trainer.train_adapters``) when they
share everything that decides which images a step sees: the data, the split, the number of steps,
the batch, the augmentation and the activation cache (``SHARED_FIELDS``). Everything else
(``VARIANT_FIELDS``) is each adapter's own: what learns, the learning rates, the schedule's shape, the
clipping.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memvit.memory_core import AdapterError, MemvitError, check_memory_norm, check_name

from .cache_key import CacheError, CacheSpec
from .device import check_device, check_precision
from .memory_init import MEMORY_INITS


class TrainingError(MemvitError):
    """A training run cannot start or resume as asked."""


@dataclass
class TrainConfig:
    """Everything that defines a run. Recorded in the bundle and checked when resuming.

    Every field is also an option of ``memvit train`` (``--kebab-case``, declared in
    ``server/cli/train.py``; a test keeps the two in step): a field's ``metadata`` gives the option's
    ``help`` text; ``cli: False`` keeps a field off the command line (``extra``; a ``--config`` file
    may still set it).
    """

    name: str = field(metadata={"help": "the new adapter's name"})
    train_dir: str = field(metadata={"help": "training images: DIR/<class>/*.jpg|png"})
    val_dir: str | None = field(
        default=None,
        metadata={"help": "validation images (default: hold out val-fraction of train-dir, seeded)"},
    )
    val_fraction: float = field(default=0.1, metadata={"help": "held-out fraction when no val-dir"})
    memory_tokens: int = field(
        default=1, metadata={"help": "memory tokens per layer (0: class token + head)"}
    )
    head_only: bool = field(default=False, metadata={"help": "train the head alone"})
    memory_norm: str = field(default="norm1", metadata={"help": "norm1 (paper) or none"})
    memory_init: str = field(
        default="tokens",
        metadata={"help": "where memory starts: normal (paper: N(0, 0.02)) or tokens (real block inputs)"},
    )
    parent: str | None = field(default=None, metadata={"help": "parent bundle: extension mode"})
    epochs: float = field(default=5.0, metadata={"help": "passes over the training images"})
    steps: int | None = field(default=None, metadata={"help": "optimiser steps (overrides epochs)"})
    batch_size: int = field(default=32, metadata={"help": "training batch size"})
    lr: float = field(default=0.05, metadata={"help": "peak SGD learning rate"})
    token_lr_scale: float = field(
        default=30.0,
        metadata={"help": "lr multiplier for the class token (its gradient is ~0.25% of its norm per step)"},
    )
    memory_lr_scale: float = field(default=1.0, metadata={"help": "lr multiplier for the memory tokens"})
    momentum: float = field(default=0.9, metadata={"help": "SGD momentum"})
    weight_decay: float = field(default=0.0, metadata={"help": "SGD weight decay"})
    warmup_fraction: float = field(default=0.05, metadata={"help": "share of steps for linear warm-up"})
    clip_grad: float = field(default=1.0, metadata={"help": "gradient-norm clip"})
    crop_scale: tuple[float, float] = field(
        default=(0.35, 1.0),
        metadata={"help": "area range of the random-resized crops: MIN MAX (none with --cache)"},
    )
    hflip: float = field(
        default=0.5,
        metadata={
            "help": "horizontal-flip probability (0 where a mirror image changes the answer: digits, text)"
        },
    )
    seed: int = field(
        default=0, metadata={"help": "seeds the split, the initialisation and the augmentation"}
    )
    init_seed: int | None = field(
        default=None,
        metadata={"help": "seeds the adapter's initialisation alone (default: seed); sweepable"},
    )
    cache: str | None = field(
        default=None,
        metadata={
            "help": "activation cache directory: the base runs once per image and view, and training reads "
            "its activations from there (built if absent, reused if it matches, refused if the base, the "
            "preprocessing or the images changed). Augmentation is then the cached views only: no random "
            "crops"
        },
    )
    cache_dtype: str = field(
        default="float16",
        metadata={"help": "storage dtype of --cache: float16, bfloat16 or float32 (float32: exact)"},
    )
    cache_views: int = field(
        default=2,
        metadata={
            "help": "views cached per image: 1 (original) or 2 (original and mirror; "
            "each epoch draws the mirror with p=hflip)"
        },
    )
    cache_store: str = field(
        default="inputs",
        metadata={
            "help": "what --cache keeps per layer: inputs (normed layer inputs: half the bytes, the "
            "faster for few adapters; float32 storage matches the uncached pass to float32 rounding) "
            "or keys-values (the uncached pass's own tensors: float32 storage matches it bit for bit)"
        },
    )
    cache_placement: str = field(
        default="auto",
        metadata={
            "help": "where --cache is read from while training: device (the training device's memory), "
            "pinned (page-locked host memory, CUDA only), disk (memory-mapped, read ahead per batch) or "
            "auto (device when it fits in half the free device memory, else pinned when it fits in half "
            "the free host memory, else disk; on the CPU: disk)"
        },
    )
    device: str = field(
        default="auto",
        metadata={"help": "where to train: auto (CUDA when present, else the CPU), cpu, cuda or cuda:N"},
    )
    precision: str = field(
        default="float32",
        metadata={
            "help": "dtype of the frozen base's pass: float32, or bfloat16 (autocast; what learns stays "
            "float32)"
        },
    )
    workers: int | None = field(
        default=None,
        metadata={
            "help": "image-decoding processes (default: on a GPU host up to 8, a core left free; on the CPU "
            "none)"
        },
    )
    eval_batch_size: int = field(default=64, metadata={"help": "batch size for validation"})
    extra: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "free-form run metadata", "cli": False}
    )

    def __post_init__(self) -> None:
        # Fail before any data is scanned; the rules themselves are AdapterWeights's.
        try:
            check_name(self.name)
            check_memory_norm(self.memory_norm)
        except AdapterError as exc:
            raise TrainingError(str(exc)) from None
        if self.memory_init not in MEMORY_INITS:
            raise TrainingError(
                f"memory_init must be one of {', '.join(MEMORY_INITS)}, got {self.memory_init!r}"
            )
        if self.memory_tokens < 0:
            raise TrainingError(f"memory tokens must be >= 0, got {self.memory_tokens}")
        if self.head_only:
            self.memory_tokens = 0  # head-only has neither memory nor a learned class token
        if self.batch_size < 1 or (self.steps is not None and self.steps < 1) or self.epochs <= 0:
            raise TrainingError("batch size, steps and epochs must be positive")
        if self.token_lr_scale <= 0 or self.memory_lr_scale <= 0:
            raise TrainingError("learning-rate scales must be positive")
        if not (
            self.lr > 0 and 0 <= self.momentum < 1 and self.clip_grad > 0 and 0 <= self.warmup_fraction < 1
        ):
            raise TrainingError("need lr > 0, 0 <= momentum < 1, clip_grad > 0 and 0 <= warmup_fraction < 1")
        self.crop_scale = tuple(self.crop_scale)
        if self.workers is not None and self.workers < 0:
            raise TrainingError(f"workers must be >= 0, got {self.workers}")
        if self.cache_placement not in PLACEMENTS:
            raise TrainingError(
                f"cache placement must be one of {', '.join(PLACEMENTS)}, got {self.cache_placement!r}"
            )
        try:
            check_device(self.device)
            check_precision(self.precision)
        except ValueError as exc:
            raise TrainingError(str(exc)) from None
        try:
            self.cache_spec()  # checks the cache settings
        except CacheError as exc:
            raise TrainingError(str(exc)) from None

    def cache_spec(self, *, rebuild: bool = False) -> CacheSpec | None:
        """The activation cache this run trains from, or None (from images)."""
        where = Path(self.cache or ".")
        spec = CacheSpec(where, self.cache_dtype, self.cache_store, self.cache_views, rebuild, self.precision)
        return spec if self.cache is not None else None

    def hyper_parameters(self) -> dict[str, Any]:
        skip = {
            "name",
            "train_dir",
            "val_dir",
            "parent",
            "workers",
            "eval_batch_size",
            "extra",
            "device",
            "cache_placement",
            *CACHE_FIELDS,
        }
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in skip}

    @property
    def memory_lr(self) -> float:
        return self.lr * self.memory_lr_scale

    @property
    def start_seed(self) -> int:
        """What seeds the initialisation: ``init_seed``, else ``seed``."""
        return self.seed if self.init_seed is None else self.init_seed

    def shared(self) -> dict[str, Any]:
        """The fields every adapter trained in the same pass must agree on."""
        return {name: getattr(self, name) for name in SHARED_FIELDS}


# What decides the images each step sees: adapters trained together share it.
SHARED_FIELDS = (
    "train_dir",
    "val_dir",
    "val_fraction",
    "parent",
    "epochs",
    "steps",
    "batch_size",
    "crop_scale",
    "hflip",
    "seed",
    "cache",
    "cache_dtype",
    "cache_views",
    "cache_store",
    "cache_placement",
    "device",
    "precision",
    "workers",
    "eval_batch_size",
)
CACHE_FIELDS = ("cache", "cache_dtype", "cache_views", "cache_store")
PLACEMENTS = ("auto", "device", "pinned", "disk")  # cache_placement (cache_placement.py)
# Where and how fast a run computes, not what it computes: a checkpoint resumes under other values.
RUNTIME_FIELDS = ("workers", "eval_batch_size", "device", "cache_placement")
# Each adapter's own: what a sweep may vary.
VARIANT_FIELDS = tuple(
    f.name for f in dataclasses.fields(TrainConfig) if f.name not in SHARED_FIELDS and f.name != "extra"
)


def check_together(configs: Sequence[TrainConfig]) -> TrainConfig:
    """The first config, once every config is known to share the data and have its own name."""
    if not configs:
        raise TrainingError("nothing to train: give at least one config")
    first = configs[0]
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise TrainingError(f"adapters trained together need distinct names, got {names}")
    for c in configs[1:]:
        differ = sorted(k for k, v in c.shared().items() if first.shared()[k] != v)
        if differ:
            raise TrainingError(
                f"{c.name!r} and {first.name!r} differ in {', '.join(differ)}: adapters trained in one "
                "pass share the data, the steps, the batch and the augmentation"
            )
    return first
