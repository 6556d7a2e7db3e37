"""The ``training`` step's ``same numbers`` rows: the paper's DeiT-Tiny CIFAR-10 comparison, one regime,
trained end to end on the device (benchmarks/train_regime.py), against the CPU's recorded run.

Per precision (float32, then bfloat16): validation top-1, the CPU run's, the difference in points and
the share of the 1,000 validation images both predict alike; the run's wall time (the data scan,
training with its decode workers, validation) next to the CPU's; training images/s and the share of
it spent waiting for batches. Goals: float32 within 1 point of the CPU run (same seed, recipe and
data order: only rounding differs), bfloat16 within 0.5 point of float32 on the device.

The regime needs the real DeiT-Tiny and the CIFAR-10 test tarball in the shared data (gpu-data/ on a
lease, benchmarks/gpu/prepare.py). ``--cpu-smoke`` runs the same code on a tiny random base and a
generated folder for 3 steps, so CI keeps it working. A failed run's row keeps where it failed
(``where``: traced.py).
"""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

from PIL import Image

from benchmarks.common import DEIT_TINY
from benchmarks.train_regime import RECORD, TARBALL, Regime, agreement, cut, train
from memvit.memory_core import MemoryViT

from .plan import Plan, engine
from .report import Budget, StepReport, goal
from .traced import traced

TABLE = "same numbers: the DeiT-Tiny CIFAR-10 regime end to end"
GOALS = {"float32": 1.0, "bfloat16": 0.5}  # points of top-1: vs the CPU's record, vs float32 here


def run(plan: Plan, report: StepReport, budget: Budget) -> str:
    smoke = plan.smoke
    if not smoke and not (DEIT_TINY.is_file() and TARBALL.is_file()):
        report.note(
            f"same numbers: not run ({DEIT_TINY} or {TARBALL} missing: MEMVIT_SHARED_DATA, docs/gpu.md)"
        )
        return "done"
    cpu = json.loads(RECORD.read_text()) if RECORD.is_file() and not smoke else None
    regime = (
        Regime(train_per_class=4, val_per_class=2, steps=3, batch_size=4, memory_tokens=1)
        if smoke
        else Regime()
    )
    if cpu is not None and cpu["regime"] != regime.__dict__:
        report.note(f"{RECORD.name} records another regime ({cpu['regime']}): no CPU comparison")
        cpu = None
    found: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="memvit-regime-") as tmp:
        root = _tiny_folders(Path(tmp), regime) if smoke else cut(Path(tmp), regime)
        for precision in ("float32", "bfloat16"):
            if not budget.allows(60 if not smoke else 5):
                report.note(f"same numbers: budget spent before {precision}")
                return "partial"
            base = engine("tiny", plan) if smoke else MemoryViT.from_timm(weights=str(DEIT_TINY))
            what = {"precision": precision, "device": str(plan.device)}
            report.attempt(TABLE, what, traced(_row), base, root, regime, precision, plan, cpu, found)
    return "done"


def _row(
    base: MemoryViT, root: Path, regime: Regime, precision: str, plan: Plan, cpu: dict | None, found: dict
) -> dict:
    figures = found[precision] = train(base, root, regime, device=str(plan.device), precision=precision)
    row = {
        "val top-1": figures["val_top1"],
        "images": figures["val_images"],
        "wall s": round(figures["seconds"], 1),
        "train img/s": round(figures["train_images_per_s"]),
        "waiting for batches": round(figures["load_share"], 3),
    }
    if cpu is not None:
        row |= {
            "CPU top-1": cpu["val_top1"],
            "vs CPU (points)": 100 * (figures["val_top1"] - cpu["val_top1"]),
            "same prediction as CPU": agreement(figures["predictions"], cpu["predictions"]),
            "CPU wall s": round(cpu["seconds"], 1),
            "CPU / this wall": cpu["seconds"] / figures["seconds"],
        }
    if precision == "float32":
        gap = None if cpu is None else abs(row["vs CPU (points)"])
        row["goal: within 1 point of the CPU"] = goal(gap, "<=", GOALS["float32"])
    elif "float32" in found:
        gap = 100 * abs(figures["val_top1"] - found["float32"]["val_top1"])
        row["vs float32 here (points)"] = gap
        row["goal: within 0.5 point of float32"] = goal(gap, "<=", GOALS["bfloat16"])
    return row


def _tiny_folders(root: Path, regime: Regime) -> Path:
    """Two classes of coloured noise in train/ and val/ (the smoke's stand-in for CIFAR-10)."""
    rng = random.Random(0)
    for part, count in (("train", regime.train_per_class), ("val", regime.val_per_class)):
        for label, colour in enumerate(((200, 40, 40), (40, 60, 200))):
            folder = root / part / f"c{label}"
            folder.mkdir(parents=True)
            for i in range(count):
                pixels = [tuple(min(255, c + rng.randint(-40, 40)) for c in colour) for _ in range(32 * 32)]
                image = Image.new("RGB", (32, 32))
                image.putdata(pixels)
                image.save(folder / f"{i}.png")
    return root
