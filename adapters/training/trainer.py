"""Fine-tune adapters against a frozen base: the paper's recipe, resumable, reproducible.

SGD with momentum, gradient-norm clipping, linear warm-up then cosine decay stepped per optimiser
step. The base runs without autograd (docs/design.md §2.3): only the class-token path is recorded, so a step
costs about one inference pass. The result is a ``memvit.adapter/1`` bundle whose ``training``
metadata records the data, the steps, the hyper-parameters and the validation accuracy.

Several adapters train in ONE pass (``train_adapters``): each batch goes through the base once, with
every adapter's class-token row alongside (docs/design.md §2.8). Rows never attend to each other, so
the summed loss gives each adapter exactly the gradient it would get alone; each has its own
optimiser, learning rates, schedule and clipping, so each ends where it would have ended alone.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from memory_core import AdapterSet, MemoryViT, PreparedAdapter

from ..attach import check_compatible
from ..bundle import AdapterBundle, bundle_for, save_bundle
from ..preprocess import eval_transform, train_transform
from ..reader import read_bundle
from .checkpoint import load_checkpoint, save_checkpoint
from .config import TrainConfig, TrainingError
from .data import ImageDataset, Samples, StreamSampler, scan_folder, split
from .memory_init import token_memory
from .metrics import Accuracy, evaluate_many
from .trainable import TrainableAdapter

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    bundle: AdapterBundle
    val: Accuracy
    steps: int
    seconds: float
    losses: list[float]
    # (step, validation top-1) at the points asked for (``curve_points``), the last at the end.
    curve: list[tuple[int, float]] = field(default_factory=list)


def warmup_cosine(total: int, warmup: int):
    """LR multiplier per optimiser step: 0 -> 1 linearly over ``warmup`` steps, then cosine to 0."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


class Variant:
    """One adapter being trained: its parameters, optimiser and schedule, and what it has seen."""

    def __init__(
        self,
        engine: MemoryViT,
        config: TrainConfig,
        classes: tuple[str, ...],
        parent: PreparedAdapter | None,
        total: int,
        init_images: torch.Tensor | None = None,
    ) -> None:
        self.config = config
        memory = None
        if config.memory_init == "tokens" and config.memory_tokens:
            assert init_images is not None, "memory_init='tokens' needs images"
            memory = token_memory(
                engine,
                init_images,
                config.memory_tokens,
                config.memory_norm,
                torch.Generator().manual_seed(config.start_seed + 1),
            )
        self.adapter = TrainableAdapter(
            engine,
            config.name,
            num_classes=len(classes),
            memory_tokens=config.memory_tokens,
            head_only=config.head_only,
            memory_norm=config.memory_norm,
            parent=parent,
            labels=classes,
            generator=torch.Generator().manual_seed(config.start_seed),
            memory=memory,
        )
        a = self.adapter
        self.params = [p for p in a.parameters() if p.requires_grad]
        groups = [{"params": list(a.head.parameters())}]
        if a.cls_token.requires_grad:
            groups.append({"params": [a.cls_token], "lr": config.lr * config.token_lr_scale})
        if a.memory.requires_grad:
            groups.append({"params": [a.memory], "lr": config.memory_lr})
        self.optimizer = torch.optim.SGD(
            groups, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
        )
        warmup = max(1, round(config.warmup_fraction * total))
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, warmup_cosine(total, warmup))
        self.losses: list[float] = []
        self.curve: list[tuple[int, float]] = []
        self.correct = 0

    @property
    def name(self) -> str:
        return self.config.name

    def state(self) -> dict:
        return {
            "adapter": self.adapter.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "schedule": self.schedule.state_dict(),
            "losses": self.losses,
            "curve": self.curve,
        }

    def load_state(self, state: dict) -> None:
        self.adapter.load_state_dict(state["adapter"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        self.losses = list(state["losses"])
        self.curve = [(int(s), float(a)) for s, a in state["curve"]]


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
    results = train_adapters(
        engine,
        [config],
        outs=None if out is None else [out],
        checkpoint=checkpoint,
        checkpoint_every=checkpoint_every,
        resume=resume,
        progress=progress,
        stop_after=stop_after,
    )
    return None if results is None else results[0]


def train_adapters(
    engine: MemoryViT,
    configs: Sequence[TrainConfig],
    *,
    outs: Sequence[str | Path] | None = None,
    checkpoint: str | Path | None = None,
    checkpoint_every: int = 50,
    resume: bool = False,
    progress: bool = True,
    stop_after: int | None = None,
    curve_points: int = 0,
) -> list[TrainResult] | None:
    """Train every config's adapter in one pass over the shared data; results in the same order.

    The configs must agree on ``SHARED_FIELDS`` (the data and the steps) and have distinct names.
    ``curve_points`` > 0 scores every adapter on the validation split that many times during the run
    (one fused pass for all of them), for learning curves. Returns None when ``stop_after`` ended it.
    """
    started = time.perf_counter()
    first = _check_together(configs)
    train_samples, val_samples = _data(first)
    parent = _parent(engine, first, [c.name for c in configs])
    per_epoch = math.ceil(len(train_samples) / first.batch_size)
    total = first.steps or max(1, round(first.epochs * per_epoch))
    init_images = None
    if any(c.memory_init == "tokens" and c.memory_tokens for c in configs):
        init_images = _init_images(engine, train_samples, first.seed)
    variants = [Variant(engine, c, train_samples.classes, parent, total, init_images) for c in configs]
    step = 0
    if resume:
        if checkpoint is None or not Path(checkpoint).is_file():
            raise TrainingError(f"nothing to resume: checkpoint {checkpoint} not found")
        step = load_checkpoint(checkpoint, engine, variants)
        log.info("resuming %s at step %d of %d", ", ".join(v.name for v in variants), step, total)

    dataset = ImageDataset(
        train_samples, train_transform(engine, scale=first.crop_scale, hflip=first.hflip), seed=first.seed
    )
    loader = DataLoader(
        dataset,
        batch_size=first.batch_size,
        sampler=StreamSampler(
            len(dataset), first.seed, total * first.batch_size, start=step * first.batch_size
        ),
        num_workers=first.workers,
        drop_last=False,
    )
    scored = {round(total * (i + 1) / curve_points) for i in range(curve_points)} if curve_points else set()
    desc = first.name if len(variants) == 1 else f"{len(variants)} adapters"
    bar = tqdm(total=total, initial=step, desc=desc, unit="step", disable=not progress, dynamic_ncols=True)
    engine.train()  # the base stays in eval mode; see MemoryViT.train
    seen, tick = 0, time.perf_counter()
    for images, labels in loader:
        fused_step(engine, variants, parent, images, labels)
        step, seen = step + 1, seen + len(labels)
        now = time.perf_counter()
        best = max(variants, key=lambda v: v.correct)
        bar.set_postfix(
            loss=f"{min(v.losses[-1] for v in variants):.3f}",
            acc=f"{best.correct / seen:.3f}",
            img_s=f"{len(labels) / (now - tick):.1f}",
        )
        bar.update(1)
        tick = now
        if step in scored and step < total:
            _score(engine, variants, parent, val_samples, step)
            engine.train()
        if checkpoint is not None and (step % checkpoint_every == 0 or step == total):
            save_checkpoint(checkpoint, engine, variants, step)
        if stop_after is not None and step >= stop_after and step < total:
            bar.close()
            engine.eval()
            return None
    bar.close()
    engine.eval()
    finals = _score(engine, variants, parent, val_samples, step)
    seconds = time.perf_counter() - started
    results = []
    for i, (variant, val) in enumerate(zip(variants, finals, strict=True)):
        bundle = _bundle(engine, variant, train_samples, val_samples, val, step, seconds)
        if outs is not None:
            save_bundle(bundle, outs[i])
            log.info("wrote %s (val top-1 %.4f)", outs[i], val.top1)
        results.append(TrainResult(bundle, val, step, seconds, variant.losses, variant.curve))
    return results


def fused_step(
    engine: MemoryViT,
    variants: list[Variant],
    parent: PreparedAdapter | None,
    images: torch.Tensor,
    labels: torch.Tensor,
) -> None:
    """One optimiser step for every variant, from one fused pass over the batch (the base runs once)."""
    prepared = tuple(engine.prepare(v.adapter.live_weights()) for v in variants)
    out = engine(images, AdapterSet(((parent,) if parent else ()) + prepared))
    losses = [F.cross_entropy(out.adapters[v.name].float(), labels) for v in variants]
    for v in variants:
        v.optimizer.zero_grad(set_to_none=True)
    # Each loss depends on its own adapter's parameters only (rows never attend to each other), so
    # the sum's gradient for each adapter is that adapter's own loss gradient.
    torch.stack(losses).sum().backward()
    for v, loss in zip(variants, losses, strict=True):
        nn.utils.clip_grad_norm_(v.params, v.config.clip_grad)
        v.optimizer.step()
        v.schedule.step()
        v.losses.append(loss.item())
        v.correct += int((out.adapters[v.name].argmax(-1) == labels).sum())


def _score(
    engine: MemoryViT, variants: list[Variant], parent: PreparedAdapter | None, val: Samples, step: int
) -> list[Accuracy]:
    """Every variant on the validation split in one fused pass per batch; adds a curve point."""
    config = variants[0].config
    accuracies = evaluate_many(
        engine,
        [v.adapter.weights() for v in variants],
        val,
        eval_transform(engine),
        batch_size=config.eval_batch_size,
        workers=config.workers,
        parent=parent,
    )
    for v, accuracy in zip(variants, accuracies, strict=True):
        if not v.curve or v.curve[-1][0] != step:
            v.curve.append((step, accuracy.top1))
    return accuracies


def _bundle(
    engine: MemoryViT,
    variant: Variant,
    train_samples: Samples,
    val_samples: Samples,
    val: Accuracy,
    step: int,
    seconds: float,
) -> AdapterBundle:
    config, losses = variant.config, variant.losses
    training = {
        "data": {
            "train_dir": config.train_dir,
            "val_dir": config.val_dir,
            "val_fraction": None if config.val_dir else config.val_fraction,
            "classes": list(train_samples.classes),
            "train_images": len(train_samples),
            "val_images": len(val_samples),
        },
        "regime": variant.adapter.regime,
        "steps": step,
        "epochs": round(step * config.batch_size / len(train_samples), 3),
        "hyper_parameters": config.hyper_parameters(),
        "val_accuracy": {"top1": val.top1, "top5": val.top5},
        "final_train_loss": sum(losses[-20:]) / max(1, len(losses[-20:])),
        "seconds": round(seconds, 1),
        **config.extra,
    }
    return bundle_for(variant.adapter.weights(), engine, training=training)


def _init_images(engine: MemoryViT, samples: Samples, seed: int, count: int = 16) -> torch.Tensor:
    """A seeded handful of training images, as the model sees them, to draw initial memory from."""
    indices = random.Random(seed).sample(range(len(samples)), min(count, len(samples)))
    dataset = ImageDataset(samples.subset(indices), eval_transform(engine))
    return torch.stack([dataset[i][0] for i in range(len(dataset))])


def _check_together(configs: Sequence[TrainConfig]) -> TrainConfig:
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


def _data(config: TrainConfig) -> tuple[Samples, Samples]:
    samples = scan_folder(config.train_dir)
    if config.val_dir:
        return samples, scan_folder(config.val_dir, classes=samples.classes)
    return split(samples, config.val_fraction, config.seed)


def _parent(engine: MemoryViT, config: TrainConfig, names: list[str]) -> PreparedAdapter | None:
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
