"""What the Table 2 run of benchmarks/paper_table_flat.py trains and how it chooses: the regimes and
their grids, the comparisons it reports, its stopping rule and its choice of grid point per seed."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.paper_table_report import GRIDS
from memvit.memory_core import AdapterWeights

REGIMES: dict[str, dict] = {
    "head only": {"head_only": True},
    "class token + head": {"memory_tokens": 0},
    "memory 1": {"memory_tokens": 1},
    "memory 5": {"memory_tokens": 5},
    "memory 10": {"memory_tokens": 10},
}
GRID = {**GRIDS, "memory 10": GRIDS["memory 5"]}
PAIRS = [
    ("class token + head", "head only"),
    *((f"memory {m}", b) for m in (1, 5, 10) for b in ("head only", "class token + head")),
    ("memory 5", "memory 1"),
    ("memory 10", "memory 1"),
]


def first_stop(cap: int, lr_fraction: float = 0.15) -> int:
    """The first epoch after which the run may stop: once the warm-up/cosine schedule over ``cap``
    epochs has brought the learning rate below ``lr_fraction`` of its peak (the last quarter of the
    schedule for 0.15). Earlier, a high learning rate's epoch-to-epoch noise passes for a plateau: a
    20-epoch CIFAR-10 run stopped at epoch 5 that way, with validation top-1 3 points below where a
    10-epoch schedule ended (benchmarks/RESULTS.md §2.7)."""
    # cosine factor 0.5 * (1 + cos(pi * t)) < lr_fraction  <=>  t > acos(2 * lr_fraction - 1) / pi
    return min(cap, math.ceil(cap * math.acos(2 * lr_fraction - 1) / math.pi))


def plateaued(curve: Sequence[float], patience: int, min_gain: float) -> bool:
    """True once the last ``patience`` points of ``curve`` gained less than ``min_gain`` over the best
    point before them (never before there are ``patience`` + 1 points)."""
    if patience < 1 or len(curve) <= patience:
        return False
    return max(curve[-patience:]) < max(curve[:-patience]) + min_gain


def seeded(regime: str) -> bool:
    """Whether the initialisation seed changes the regime's run (only memory is drawn at random)."""
    return bool(REGIMES[regime].get("memory_tokens"))


def grid_points(regime: str, args, arm: Arm) -> int:
    """How many points of the regime's grid the arm trains (memory regimes may take fewer)."""
    n = args.grid_points
    if REGIMES[regime].get("memory_tokens") and args.memory_grid_points is not None:
        n = args.memory_grid_points
    return n if arm.grid_points is None else min(n, arm.grid_points)


@dataclass
class Arm:
    """One way of training every regime: its training images and where its batches come from."""

    name: str
    train_dir: Path
    cache: Path | None  # None: from the images (random-resized crops + flips)
    views: int = 1
    hflip: float = 0.0
    grid_points: int | None = None  # at most this many points of each grid


@dataclass
class Trained:
    regime: str
    grid: int
    seed: int
    curve: list[float]  # validation top-1 after each epoch
    best_epoch: int
    weights: AdapterWeights  # at the best epoch (what validation chooses)
    last: AdapterWeights | None = None  # at the last epoch run (no choice of epoch at all)

    @property
    def best(self) -> float:
        return self.curve[self.best_epoch - 1]


def choose(trained: list[Trained], seeds: list[int]) -> dict[str, dict[int, Trained]]:
    """Per regime and seed: the grid point with the best validation top-1 at its best epoch (ties: the
    first). Unseeded regimes stand for every seed with their one run."""
    chosen: dict[str, dict[int, Trained]] = {}
    for t in trained:
        for seed in seeds if not seeded(t.regime) else [t.seed]:
            best = chosen.setdefault(t.regime, {}).get(seed)
            if best is None or t.best > best.best:
                chosen[t.regime][seed] = t
    return chosen
