"""What training hands back: one adapter's result, and a sweep's variants with the one chosen.

Shared by the run that produces them (``run``, ``sweep``) and the report that reads them (``report``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..bundle.format import AdapterBundle
from .config import TrainConfig
from .metrics import Accuracy


@dataclass
class TrainResult:
    bundle: AdapterBundle
    val: Accuracy
    steps: int
    seconds: float
    losses: list[float]
    # (step, validation top-1) at the points asked for (``curve_points``), the last at the end.
    curve: list[tuple[int, float]] = field(default_factory=list)
    # What the training images went through, e.g. "cached views: original+hflip (mirror with p=0.5), ..."
    augmentation: str = ""


@dataclass(frozen=True)
class SweepVariant:
    config: TrainConfig
    overrides: dict[str, Any]  # the swept fields' values for this variant
    result: TrainResult


@dataclass(frozen=True)
class SweepResult:
    variants: list[SweepVariant]
    best: int  # index of the variant with the best validation top-1
    out_dir: Path | None

    @property
    def chosen(self) -> SweepVariant:
        return self.variants[self.best]
