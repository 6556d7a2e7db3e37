"""A training run: adapters for one base that share the data, trained together step by step.

    run = TrainingRun(engine, configs, checkpoint="run.ckpt")  # scans the data, builds each variant
    run.resume()                # optional: carry on from the checkpoint
    run.run(until=100)          # or run.step(): one optimiser step for every variant
    run.run()                   # to the end; curve points and checkpoints as they fall due
    results = run.finish(outs)  # the final validation, and the bundles (written to ``outs``)

``trainer.train_adapters`` and ``trainer.train_adapter`` do all of that in one call.

SGD with momentum, gradient-norm clipping, linear warm-up then cosine decay stepped per optimiser
step. The run computes on ``config.device`` (the engine is moved there) in ``config.precision``
(device.py). The base runs without autograd (docs/design.md §2.3): only the class-token path is
recorded, so a step costs about one inference pass; on CUDA the whole step (the adapters'
preparation, the pass, its way back and the update) is one CUDA graph (step_graph.py). Each batch
goes through the base once for every adapter (``step.TrainStep``; docs/design.md §2.8). The result
is a ``memvit.adapter/1`` bundle per adapter whose ``training`` metadata records the data, the
steps, the hyper-parameters, the device and the validation accuracy.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path

from memvit.memory_core import MemoryViT

from ..bundle.format import AdapterBundle, bundle_for, save_bundle
from ..preprocess import eval_transform
from . import setup
from .batches import Feed, batches
from .cache_stream import augmentation
from .checkpoint import read_checkpoint, write_checkpoint
from .config import TrainConfig, TrainingError, check_together
from .device import describe
from .metrics import Accuracy, evaluate_many
from .progress import Progress
from .results import TrainResult
from .step import TrainStep
from .variant import Variant

log = logging.getLogger(__name__)

FLUSH_EVERY = 200  # steps whose losses may wait on the device before they are read back


class TrainingRun:
    """Configs that share the data (``config.SHARED_FIELDS``), their variants, the step loop, the
    learning-curve points and the checkpoints of one run."""

    def __init__(
        self,
        engine: MemoryViT,
        configs: Sequence[TrainConfig],
        *,
        checkpoint: str | Path | None = None,
        checkpoint_every: int = 50,
        curve_points: int = 0,
        progress: bool = True,
        rebuild_cache: bool = False,
    ) -> None:
        """Check the configs, scan the data, open or build the activation caches (``config.cache``) and
        build every variant; ``curve_points`` > 0 scores every variant on the validation split that
        many times during the run (one fused pass for all)."""
        self._started = time.perf_counter()
        self.engine = engine
        self.config = check_together(configs)  # the first; every config shares its data and steps
        self.device = setup.device_for(engine, self.config)  # the engine moves there
        self.workers = setup.workers_for(self.config, self.device)
        self.train_samples, self.val_samples = setup.data(self.config)
        self.train_cache, self.val_cache = setup.caches(
            engine, self.config, (self.train_samples, self.val_samples), rebuild_cache, progress, self.workers
        )
        self.parent = setup.parent(engine, self.config, [c.name for c in configs])
        per_epoch = math.ceil(len(self.train_samples) / self.config.batch_size)
        self.total = self.config.steps or max(1, round(self.config.epochs * per_epoch))
        init_images = None
        if any(c.memory_init == "tokens" and c.memory_tokens for c in configs):
            init_images = setup.init_images(engine, self.train_samples, self.config.seed)
        classes = self.train_samples.classes
        self.variants = [Variant(engine, c, classes, self.parent, self.total, init_images) for c in configs]
        self.train_step = TrainStep(engine, self.variants, self.parent, self.config.precision)
        self.checkpoint = None if checkpoint is None else Path(checkpoint)
        self.checkpoint_every = checkpoint_every
        self.curve_steps = {round(self.total * (i + 1) / curve_points) for i in range(curve_points)}
        self.progress = progress
        self.steps = 0  # optimiser steps taken (a resumed run counts those before the checkpoint)
        self.seen = 0  # images trained on in this process (the progress bar's running accuracy)
        self._batches: Feed | None = None
        self.speed: dict[str, float] = {}  # the last ``run``'s images/s and where its time went

    @property
    def augmentation(self) -> str:
        """What the training images go through, in words (recorded in every bundle)."""
        views = None if self.train_cache is None else self.train_cache.views
        return augmentation(views, self.config.hflip, self.config.crop_scale)

    @property
    def finished(self) -> bool:
        return self.steps >= self.total

    def resume(self) -> None:
        """Continue from the checkpoint: every variant's state, and the step it was written at."""
        if self.checkpoint is None or not self.checkpoint.is_file():
            raise TrainingError(f"nothing to resume: checkpoint {self.checkpoint} not found")
        if self.steps or self._batches is not None:
            raise TrainingError("resume before the first step, not after")
        self.steps = read_checkpoint(self.checkpoint, self.engine, self.variants)
        names = ", ".join(v.name for v in self.variants)
        log.info("resuming %s at step %d of %d", names, self.steps, self.total)

    def save_checkpoint(self) -> None:
        """Write the checkpoint now (``step`` writes it every ``checkpoint_every`` steps and at the end)."""
        if self.checkpoint is None:
            raise TrainingError("this run has no checkpoint file")
        self.train_step.flush()
        write_checkpoint(self.checkpoint, self.engine, self.variants, self.steps)

    def step(self) -> None:
        """One optimiser step for every variant on the next batch; then a curve point and a checkpoint
        where one falls due."""
        if self.finished:
            raise TrainingError(f"the run is finished ({self.total} steps)")
        if self._batches is None:
            source = batches(
                self.engine,
                self.config,
                self.train_samples,
                self.train_cache,
                total=self.total,
                start=self.steps,
                workers=self.workers,
            )
            self._batches = Feed(source, self.device)
        images, labels = next(self._batches)
        if not self.engine.training:
            self.engine.train()  # the base stays in eval mode; see MemoryViT.train
        self.train_step(images, labels)
        self.steps += 1
        self.seen += len(labels)
        if self.steps in self.curve_steps and not self.finished:  # the last point is finish()'s
            self._score()
        if self.checkpoint is not None and (self.steps % self.checkpoint_every == 0 or self.finished):
            self.save_checkpoint()

    def run(self, until: int | None = None) -> None:
        """Step to step ``until`` (default: the end), with a progress bar; the engine ends in eval mode."""
        stop = self.total if until is None else min(until, self.total)
        desc = self.config.name if len(self.variants) == 1 else f"{len(self.variants)} adapters"
        bar = Progress(self.total, self.steps, desc, enabled=self.progress)
        try:
            while self.steps < stop:
                self.step()
                assert self._batches is not None
                due = bar.advance(self.config.batch_size, self._batches.take_waited())
                if len(self.train_step.pending) >= FLUSH_EVERY:  # without a bar too: bounded memory
                    self.train_step.flush()
                if due:
                    self.train_step.flush()  # the one read-back of the steps' losses
                    best = max(self.variants, key=lambda v: v.correct)
                    bar.show(min(v.losses[-1] for v in self.variants), best.correct / max(1, self.seen))
        finally:
            bar.close()
            self.speed = bar.summary()
            self.train_step.flush()
            self.engine.eval()

    def finish(self, outs: Sequence[str | Path] | None = None) -> list[TrainResult]:
        """Score every variant on validation and make its bundle (written to ``outs``, in order)."""
        if not self.finished:
            raise TrainingError(f"the run is at step {self.steps} of {self.total}: run it to the end first")
        self._batches = None
        self.train_step.flush()
        finals = self._score()
        seconds = time.perf_counter() - self._started
        results = []
        for i, (variant, val) in enumerate(zip(self.variants, finals, strict=True)):
            bundle = self._bundle(variant, val, seconds)
            if outs is not None:
                save_bundle(bundle, outs[i])
                log.info("wrote %s (val top-1 %.4f)", outs[i], val.top1)
            results.append(
                TrainResult(
                    bundle, val, self.steps, seconds, variant.losses, variant.curve, self.augmentation
                )
            )
        return results

    def _score(self) -> list[Accuracy]:
        """Every variant on the validation split in one fused pass per batch; adds a curve point."""
        self.train_step.flush()
        self.engine.eval()
        accuracies = evaluate_many(
            self.engine,
            [v.adapter.weights() for v in self.variants],
            self.val_samples,
            eval_transform(self.engine),
            batch_size=self.config.eval_batch_size,
            workers=self.workers,
            parent=self.parent,
            cache=self.val_cache,
            precision=self.config.precision,
        )
        for v, accuracy in zip(self.variants, accuracies, strict=True):
            if not v.curve or v.curve[-1][0] != self.steps:
                v.curve.append((self.steps, accuracy.top1))
        return accuracies

    def _bundle(self, variant: Variant, val: Accuracy, seconds: float) -> AdapterBundle:
        config, losses, train = variant.config, variant.losses, self.train_samples
        training = {
            "data": {
                "train_dir": config.train_dir,
                "val_dir": config.val_dir,
                "val_fraction": None if config.val_dir else config.val_fraction,
                "classes": list(train.classes),
                "train_images": len(train),
                "val_images": len(self.val_samples),
            },
            "regime": variant.adapter.regime,
            "augmentation": self.augmentation,
            "cache": None if self.train_cache is None else self.train_cache.describe(),
            "steps": self.steps,
            "epochs": round(self.steps * config.batch_size / len(train), 3),
            "hyper_parameters": config.hyper_parameters(),
            "val_accuracy": {"top1": val.top1, "top5": val.top5},
            "final_train_loss": sum(losses[-20:]) / max(1, len(losses[-20:])),
            "seconds": round(seconds, 1),
            "device": describe(self.device),
            "speed": {k: round(v, 3) for k, v in self.speed.items()},
            **config.extra,
        }
        return bundle_for(variant.adapter.weights(), self.engine, training=training)
