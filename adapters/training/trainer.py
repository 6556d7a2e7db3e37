"""Training in one call: ``train_adapters`` (several adapters in one pass over their shared data) and
``train_adapter`` (one), over a ``run.TrainingRun`` run from start (or checkpoint) to end.

Several adapters for one base train in ONE pass: each batch goes through the base once, with every
adapter's class-token row alongside (docs/design.md §2.8), and each ends where it would have ended
trained alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from memvit.memory_core import MemoryViT

from .config import TrainConfig
from .results import TrainResult
from .run import TrainingRun


def train_adapters(
    engine: MemoryViT,
    configs: Sequence[TrainConfig],
    *,
    outs: Sequence[str | Path] | None = None,
    checkpoint: str | Path | None = None,
    checkpoint_every: int = 50,
    resume: bool = False,
    progress: bool = True,
    curve_points: int = 0,
    rebuild_cache: bool = False,
) -> list[TrainResult]:
    """Train every config's adapter in one run over the shared data; results in the same order.

    The configs must agree on ``SHARED_FIELDS`` (the data, the steps, the cache) and have distinct
    names. ``curve_points`` > 0 scores every adapter on the validation split that many times during
    the run (one fused pass for all of them), for learning curves. ``resume`` continues from
    ``checkpoint``; ``rebuild_cache`` replaces the activation cache (``config.cache``) however it
    matches."""
    run = TrainingRun(
        engine,
        configs,
        checkpoint=checkpoint,
        checkpoint_every=checkpoint_every,
        curve_points=curve_points,
        progress=progress,
        rebuild_cache=rebuild_cache,
    )
    if resume:
        run.resume()
    run.run()
    return run.finish(outs)


def train_adapter(
    engine: MemoryViT,
    config: TrainConfig,
    *,
    out: str | Path | None = None,
    checkpoint: str | Path | None = None,
    checkpoint_every: int = 50,
    resume: bool = False,
    progress: bool = True,
    rebuild_cache: bool = False,
) -> TrainResult:
    """Train one adapter, validate it and (if ``out``) write its bundle."""
    (result,) = train_adapters(
        engine,
        [config],
        outs=None if out is None else [out],
        checkpoint=checkpoint,
        checkpoint_every=checkpoint_every,
        resume=resume,
        progress=progress,
        rebuild_cache=rebuild_cache,
    )
    return result
