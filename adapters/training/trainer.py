"""Fine-tune one adapter against a frozen base: the paper's recipe, resumable, reproducible.

SGD with momentum, gradient-norm clipping, linear warm-up then cosine decay stepped per optimiser
step. The base runs without autograd (docs/design.md §2.3): only the class-token path is recorded, so a step
costs about one inference pass. The result is a ``memvit.adapter/1`` bundle whose ``training``
metadata records the data, the steps, the hyper-parameters and the validation accuracy.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from tqdm import tqdm

from memory_core import AdapterError, MemoryViT, MemvitError, check_memory_norm, check_name

from ..attach import check_compatible
from ..bundle import AdapterBundle, bundle_for, save_bundle, write_atomic
from ..preprocess import eval_transform, train_transform
from ..reader import read_bundle
from .data import ImageDataset, Samples, StreamSampler, scan_folder, split
from .metrics import Accuracy, evaluate_set
from .trainable import TrainableAdapter

log = logging.getLogger(__name__)
CHECKPOINT_VERSION = 1


class TrainingError(MemvitError):
    """A training run cannot start or resume as asked."""


@dataclass
class TrainConfig:
    """Everything that defines a run. Recorded in the bundle and checked when resuming.

    Every field is also an option of ``memvit train`` (``--kebab-case``), generated from these
    declarations by ``server/cli.py``: a field's ``metadata`` gives its ``help`` text; ``path``
    marks a field holding a filesystem path (the command line takes a path and passes its string);
    ``cli: False`` keeps a field off the command line (``extra``; a ``--config`` file may still set it).
    """

    name: str = field(metadata={"help": "the new adapter's name"})
    train_dir: str = field(metadata={"help": "training images: DIR/<class>/*.jpg|png", "path": True})
    val_dir: str | None = field(
        default=None,
        metadata={
            "help": "validation images (default: hold out val-fraction of train-dir, seeded)",
            "path": True,
        },
    )
    val_fraction: float = field(default=0.1, metadata={"help": "held-out fraction when no val-dir"})
    memory_tokens: int = field(
        default=1, metadata={"help": "memory tokens per layer (0: class token + head)"}
    )
    head_only: bool = field(default=False, metadata={"help": "train the head alone"})
    memory_norm: str = field(default="norm1", metadata={"help": "norm1 (paper) or none"})
    parent: str | None = field(default=None, metadata={"help": "parent bundle: extension mode", "path": True})
    epochs: float = field(default=5.0, metadata={"help": "passes over the training images"})
    steps: int | None = field(default=None, metadata={"help": "optimiser steps (overrides epochs)"})
    batch_size: int = field(default=32, metadata={"help": "training batch size"})
    lr: float = field(default=0.05, metadata={"help": "peak SGD learning rate"})
    token_lr_scale: float = field(
        default=1.0, metadata={"help": "lr multiplier for the class token and memory (prompt-like inputs)"}
    )
    momentum: float = field(default=0.9, metadata={"help": "SGD momentum"})
    weight_decay: float = field(default=0.0, metadata={"help": "SGD weight decay"})
    warmup_fraction: float = field(default=0.05, metadata={"help": "share of steps for linear warm-up"})
    clip_grad: float = field(default=1.0, metadata={"help": "gradient-norm clip"})
    crop_scale: tuple[float, float] = field(
        default=(0.35, 1.0), metadata={"help": "area range of the random-resized crops: MIN MAX"}
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
    workers: int = field(default=0, metadata={"help": "data-loading processes"})
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
        if self.memory_tokens < 0:
            raise TrainingError(f"memory tokens must be >= 0, got {self.memory_tokens}")
        if self.head_only:
            self.memory_tokens = 0  # head-only has neither memory nor a learned class token
        if self.batch_size < 1 or (self.steps is not None and self.steps < 1) or self.epochs <= 0:
            raise TrainingError("batch size, steps and epochs must be positive")
        if not (
            self.lr > 0 and 0 <= self.momentum < 1 and self.clip_grad > 0 and 0 <= self.warmup_fraction < 1
        ):
            raise TrainingError("need lr > 0, 0 <= momentum < 1, clip_grad > 0 and 0 <= warmup_fraction < 1")
        self.crop_scale = tuple(self.crop_scale)

    def hyper_parameters(self) -> dict[str, Any]:
        skip = {"name", "train_dir", "val_dir", "parent", "workers", "eval_batch_size", "extra"}
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in skip}


@dataclass
class TrainResult:
    bundle: AdapterBundle
    val: Accuracy
    steps: int
    seconds: float
    losses: list[float]


def warmup_cosine(total: int, warmup: int):
    """LR multiplier per optimiser step: 0 -> 1 linearly over ``warmup`` steps, then cosine to 0."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def train_adapter(
    engine: MemoryViT,
    config: TrainConfig,
    *,
    out: str | Path | None = None,
    checkpoint: str | Path | None = None,
    checkpoint_every: int = 50,
    resume: bool = False,
    progress: bool = True,
    stop_after: int | None = None,
) -> TrainResult | None:
    """Train, validate and (if ``out``) write the bundle. ``stop_after`` ends early (for tests of resume)."""
    started = time.perf_counter()
    train_samples, val_samples = _data(config)
    parent = _parent(engine, config)
    generator = torch.Generator().manual_seed(config.seed)
    adapter = TrainableAdapter(
        engine,
        config.name,
        num_classes=len(train_samples.classes),
        memory_tokens=config.memory_tokens,
        head_only=config.head_only,
        memory_norm=config.memory_norm,
        parent=parent,
        labels=train_samples.classes,
        generator=generator,
    )
    params = [p for p in adapter.parameters() if p.requires_grad]
    tokens = [p for p in (adapter.cls_token, adapter.memory) if p.requires_grad]
    groups = [{"params": list(adapter.head.parameters())}]
    if tokens:
        groups.append({"params": tokens, "lr": config.lr * config.token_lr_scale})
    optimizer = torch.optim.SGD(
        groups, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
    )
    per_epoch = math.ceil(len(train_samples) / config.batch_size)
    total = config.steps or max(1, round(config.epochs * per_epoch))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(total, max(1, round(config.warmup_fraction * total)))
    )
    step, losses = 0, []
    if resume:
        if checkpoint is None or not Path(checkpoint).is_file():
            raise TrainingError(f"nothing to resume: checkpoint {checkpoint} not found")
        step, losses = _load_checkpoint(checkpoint, engine, config, adapter, optimizer, schedule)
        log.info("resuming %s at step %d of %d", config.name, step, total)

    dataset = ImageDataset(
        train_samples, train_transform(engine, scale=config.crop_scale, hflip=config.hflip), seed=config.seed
    )
    loader = DataLoader(
        dataset,
        batch_size=config.batch_size,
        sampler=StreamSampler(
            len(dataset), config.seed, total * config.batch_size, start=step * config.batch_size
        ),
        num_workers=config.workers,
        drop_last=False,
    )
    engine.train()  # the base stays in eval mode; see MemoryViT.train
    bar = tqdm(
        total=total, initial=step, desc=config.name, unit="step", disable=not progress, dynamic_ncols=True
    )
    correct = seen = 0
    tick = time.perf_counter()
    for images, labels in loader:
        logits = adapter(images)
        loss = F.cross_entropy(logits.float(), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, config.clip_grad)
        optimizer.step()
        schedule.step()
        step += 1
        losses.append(loss.item())
        correct += (logits.argmax(-1) == labels).sum().item()
        seen += len(labels)
        now = time.perf_counter()
        bar.set_postfix(
            loss=f"{losses[-1]:.3f}", acc=f"{correct / seen:.3f}", img_s=f"{len(labels) / (now - tick):.1f}"
        )
        bar.update(1)
        tick = now
        if checkpoint is not None and (step % checkpoint_every == 0 or step == total):
            _save_checkpoint(checkpoint, engine, config, adapter, optimizer, schedule, step, losses)
        if stop_after is not None and step >= stop_after and step < total:
            bar.close()
            engine.eval()
            return None
    bar.close()
    engine.eval()

    weights = adapter.weights()
    val = evaluate_set(
        engine,
        weights,
        val_samples,
        eval_transform(engine),
        batch_size=config.eval_batch_size,
        workers=config.workers,
        parent=parent,
    )
    seconds = time.perf_counter() - started
    training = {
        "data": {
            "train_dir": config.train_dir,
            "val_dir": config.val_dir,
            "val_fraction": None if config.val_dir else config.val_fraction,
            "classes": list(train_samples.classes),
            "train_images": len(train_samples),
            "val_images": len(val_samples),
        },
        "regime": adapter.regime,
        "steps": step,
        "epochs": round(step * config.batch_size / len(train_samples), 3),
        "hyper_parameters": config.hyper_parameters(),
        "val_accuracy": {"top1": val.top1, "top5": val.top5},
        "final_train_loss": sum(losses[-20:]) / max(1, len(losses[-20:])),
        "seconds": round(seconds, 1),
        **config.extra,
    }
    bundle = bundle_for(weights, engine, training=training)
    if out is not None:
        save_bundle(bundle, out)
        log.info("wrote %s (val top-1 %.4f)", out, val.top1)
    return TrainResult(bundle=bundle, val=val, steps=step, seconds=seconds, losses=losses)


def _data(config: TrainConfig) -> tuple[Samples, Samples]:
    samples = scan_folder(config.train_dir)
    if config.val_dir:
        return samples, scan_folder(config.val_dir, classes=samples.classes)
    return split(samples, config.val_fraction, config.seed)


def _parent(engine: MemoryViT, config: TrainConfig):
    if config.parent is None:
        return None
    bundle = read_bundle(config.parent)
    check_compatible(bundle, engine)
    if bundle.weights.parent is not None:
        raise TrainingError(
            f"parent {bundle.name!r} itself extends {bundle.weights.parent!r}; "
            "training on top of a chain is not supported yet"
        )
    if bundle.name == config.name:
        raise TrainingError(f"the new adapter cannot have its parent's name {config.name!r}")
    return engine.prepare(bundle.weights)


def _save_checkpoint(path, engine, config, adapter, optimizer, schedule, step, losses) -> None:
    state = {
        "version": CHECKPOINT_VERSION,
        "base_fingerprint": engine.fingerprint,
        "config": _config_key(config),
        "step": step,
        "losses": losses,
        "adapter": {k: v for k, v in adapter.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "schedule": schedule.state_dict(),
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    write_atomic(path, buffer.getvalue())


def _load_checkpoint(path, engine, config, adapter, optimizer, schedule) -> tuple[int, list[float]]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)  # never unpickles code
    except Exception as exc:
        raise TrainingError(f"cannot read checkpoint {path}: {exc}") from exc
    if state.get("version") != CHECKPOINT_VERSION:
        raise TrainingError(f"{path}: unknown checkpoint version {state.get('version')}")
    if state["base_fingerprint"] != engine.fingerprint:
        raise TrainingError(f"{path} was written for other base weights")
    if state["config"] != _config_key(config):
        changed = sorted(k for k in state["config"] if state["config"][k] != _config_key(config).get(k))
        raise TrainingError(
            f"{path} was written with different settings ({', '.join(changed)}); start afresh"
        )
    adapter.load_state_dict(state["adapter"])
    optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["schedule"])
    return int(state["step"]), list(state["losses"])


def _config_key(config: TrainConfig) -> dict[str, Any]:
    # Everything that shapes the run; workers and eval batch size do not change the result.
    key = dataclasses.asdict(config)
    for k in ("workers", "eval_batch_size", "extra"):
        key.pop(k)
    key["crop_scale"] = list(key["crop_scale"])
    return key
