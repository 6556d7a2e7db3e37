"""The paper's DeiT-Tiny CIFAR-10 comparison (RESULTS §2.2), one regime, end to end, on any device.

    python -m benchmarks.train_regime --device cpu --record    # the CPU reference (~10 min on 2 cores)
    python -m benchmarks.train_regime --device cuda --precision bfloat16

§2.2's "memory 5" regime at its defaults (lr 0.05, class token x30, memory x1, memory drawn from
block inputs, norm1; crops 0.35-1 and flips; batch 32; 5% warm-up then cosine; clip 1), on the real
DeiT-Tiny, reduced to fit a GPU lease: the data comes from the CIFAR-10 test tarball (3.3 MB, the
CIFAR file a lease carries: docs/gpu.md): training images are its first 200 per class (2,000),
validation images the next 100 per class (1,000, disjoint); 300 steps (4.8 epochs), seed 0. The run
is ``memvit train``'s (``train_adapter``) and its wall time is the run's own (the data scan, the
training, the validation); the validation predictions are kept, so a GPU run can be compared image
by image with the CPU's (``--record`` writes them to ``benchmarks/train_regime_cpu.json``; the GPU
suite's ``training`` step reads that file: benchmarks/gpu/training_regime.py).
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import CIFAR10, DEIT_TINY, REPO, argument_parser, environment, pin_malloc
from benchmarks.datasets import cifar_tar_to_folder
from memvit.adapters.preprocess import eval_transform
from memvit.adapters.training import TrainConfig, TrainResult, scan_folder, train_adapter
from memvit.adapters.training.metrics import _batches
from memvit.memory_core import MemoryViT

TARBALL = CIFAR10 / "cifar10_jpg_test_10k.tar.gz"
RECORD = REPO / "benchmarks" / "train_regime_cpu.json"


@dataclass(frozen=True)
class Regime:
    """What the comparison trains: the data cut and the recipe (the rest is TrainConfig's defaults)."""

    train_per_class: int = 200
    val_per_class: int = 100
    steps: int = 300
    batch_size: int = 32
    memory_tokens: int = 5
    seed: int = 0

    def config(self, root: Path, **overrides: Any) -> TrainConfig:
        return TrainConfig(
            name="cifar10-memory-5",
            train_dir=str(root / "train"),
            val_dir=str(root / "val"),
            memory_tokens=self.memory_tokens,
            steps=self.steps,
            batch_size=self.batch_size,
            seed=self.seed,
            **overrides,
        )


def cut(root: Path, regime: Regime, tarball: Path = TARBALL) -> Path:
    """The training and validation folders under ``root``, from the tarball."""
    if not tarball.is_file():
        raise FileNotFoundError(f"{tarball} not found (set MEMVIT_SHARED_DATA to the shared data)")
    cifar_tar_to_folder(tarball, root / "train", per_class=regime.train_per_class)
    cifar_tar_to_folder(
        tarball, root / "val", per_class=regime.val_per_class, skip_per_class=regime.train_per_class
    )
    return root


@torch.inference_mode()
def predictions(engine: MemoryViT, result: TrainResult, val_dir: Path, precision: str) -> list[int]:
    """Each validation image's predicted class, as the run's validation computed it."""
    samples = scan_folder(val_dir)
    adapter_set = engine.prepare_set([result.bundle.weights])
    name = result.bundle.weights.name
    out: list[int] = []
    for batch, _ in _batches(samples, eval_transform(engine), 64, 0, engine=engine, precision=precision):
        out += engine(batch, adapter_set).adapters[name].argmax(-1).tolist()
    return out


def train(
    engine: MemoryViT, root: Path, regime: Regime, *, device: str, precision: str, progress: bool = False
) -> dict[str, Any]:
    """One run of the regime: its validation top-1, wall and process-CPU seconds, images/s and
    predictions (the CPU seconds are what a shared host's wall clock cannot give: every thread's time)."""
    config = regime.config(root, device=device, precision=precision)
    cpu = time.process_time()
    result = train_adapter(engine, config, progress=progress)
    cpu = time.process_time() - cpu
    speed = result.bundle.training["speed"]
    return {
        "device": result.bundle.training["device"],
        "precision": precision,
        "val_top1": result.val.top1,
        "val_images": result.val.images,
        "seconds": result.seconds,
        "cpu_seconds": cpu,
        "train_images_per_s": speed["images_per_s"],
        "load_share": speed["load_share"],
        "final_train_loss": result.bundle.training["final_train_loss"],
        "predictions": predictions(engine, result, root / "val", precision),
    }


def agreement(a: list[int], b: list[int]) -> float:
    """The share of images two runs predict alike."""
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--precision", default="float32")
    parser.add_argument("--steps", type=int, default=Regime.steps, help="fewer for a quick look")
    parser.add_argument("--record", action="store_true", help=f"write the figures to {RECORD.name}")
    args = parser.parse_args(argv)
    malloc = pin_malloc()
    regime = Regime(steps=args.steps)
    if not DEIT_TINY.is_file():
        raise SystemExit(f"real DeiT-Tiny weights not found at {DEIT_TINY} (set MEMVIT_SHARED_DATA)")
    with tempfile.TemporaryDirectory(prefix="memvit-regime-") as tmp:
        root = cut(Path(tmp), regime)
        engine = MemoryViT.from_timm(weights=str(DEIT_TINY))
        figures = train(engine, root, regime, device=args.device, precision=args.precision, progress=True)
    print(environment("DeiT-Tiny (real)", f"{figures['device']}, {args.precision}", malloc))
    print(f"regime: {regime}")
    print(
        f"val top-1 {figures['val_top1']:.4f} on {figures['val_images']} images; {figures['seconds']:.1f} s "
        f"end to end ({figures['cpu_seconds']:.0f} s of CPU time); "
        f"training {figures['train_images_per_s']:.0f} images/s, "
        f"{100 * figures['load_share']:.0f}% of it waiting for batches"
    )
    if RECORD.is_file() and not args.record:
        cpu = json.loads(RECORD.read_text())
        if cpu["regime"] == regime.__dict__:
            print(
                f"against the recorded CPU run: top-1 {cpu['val_top1']:.4f} "
                f"({100 * (figures['val_top1'] - cpu['val_top1']):+.2f} points), same prediction on "
                f"{agreement(figures['predictions'], cpu['predictions']):.1%} of images, "
                f"{cpu['seconds'] / figures['seconds']:.1f}x its wall time"
            )
    if args.record:
        RECORD.write_text(json.dumps({"regime": regime.__dict__, **figures}, indent=None) + "\n")
        print(f"recorded in {RECORD}")


if __name__ == "__main__":
    main()
