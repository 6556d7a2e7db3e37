"""The paper's Table 2 in miniature, then the concatenation claim, on the real DeiT-Tiny.

    python -m benchmarks.paper_table                 # ~35 minutes on 2 CPU cores

1. Fine-tunes DeiT-Tiny (frozen, ImageNet weights from the shared data's deit_tiny/) on subsets of
   CIFAR-10 (the shared data's cifar10/) and Fashion-MNIST (Debian's dataset-fashion-mnist) in four
   regimes with the same budget each: head only, class token + head, memory 1, memory 5.
2. Loads the best adapter of each dataset into ONE engine and checks that the fused pass gives the
   base's ImageNet predictions unchanged (real photos, against plain timm) and both adapters'
   accuracies unchanged (against each adapter alone).

The shared data is ../shared/data, or $MEMVIT_SHARED_DATA (benchmarks/common.py). Prints markdown
for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import timm
import torch

from adapters import attach_bundle
from adapters.preprocess import eval_transform, to_rgb
from adapters.training import TrainConfig, evaluate_tasks, train_adapter
from benchmarks.common import (
    CIFAR10,
    DEIT_TINY,
    argument_parser,
    deit_tiny_engine,
    natural_photos,
    pin_malloc,
)
from benchmarks.datasets import (
    FASHION_MNIST_CLASSES,
    arrays_to_folder,
    cifar_tar_to_folder,
    fashion_mnist_split,
)
from memory_core import MemoryViT

REGIMES = {
    "head only": {"head_only": True},
    "class token + head": {"memory_tokens": 0},
    "memory 1": {"memory_tokens": 1},
    "memory 5": {"memory_tokens": 5},
}


def prepare_data(root: Path, train_per_class: int, val_per_class: int) -> dict[str, tuple[Path, Path]]:
    data = {}
    cifar = root / f"cifar10-{train_per_class}-{val_per_class}"
    if not (cifar / "val").is_dir():
        cifar_tar_to_folder(
            CIFAR10 / "cifar10_jpg_train_50k.tar.gz", cifar / "train", per_class=train_per_class
        )
        cifar_tar_to_folder(CIFAR10 / "cifar10_jpg_test_10k.tar.gz", cifar / "val", per_class=val_per_class)
    data["cifar10"] = (cifar / "train", cifar / "val")
    fashion = root / f"fashion-mnist-{train_per_class}-{val_per_class}"
    if not (fashion / "val").is_dir():
        images, labels = fashion_mnist_split("train")
        arrays_to_folder(images, labels, FASHION_MNIST_CLASSES, fashion / "train", per_class=train_per_class)
        images, labels = fashion_mnist_split("t10k")
        arrays_to_folder(images, labels, FASHION_MNIST_CLASSES, fashion / "val", per_class=val_per_class)
    data["fashion-mnist"] = (fashion / "train", fashion / "val")
    return data


def base_predictions_unchanged(engine: MemoryViT) -> tuple[float, list[str]]:
    """Max |logit| difference between the fused pass and plain timm on the real photos, and top-1s."""
    from PIL import Image

    reference = timm.create_model("deit_tiny_patch16_224", num_classes=1000)
    reference.load_state_dict(timm.models.load_state_dict(str(DEIT_TINY)))
    reference.eval()
    transform = eval_transform(engine)
    photos = natural_photos()
    x = torch.stack([transform(to_rgb(Image.open(p))) for p in photos])
    with torch.inference_mode():
        fused = engine(x).base
        plain = reference(x)
    labels = engine.labels or ()
    tops = [
        f"{p.name}: {labels[int(i)].split(' ', 1)[-1]}" for p, i in zip(photos, fused.argmax(-1), strict=True)
    ]
    same = bool((fused.topk(5).indices == plain.topk(5).indices).all())
    return (fused - plain).abs().max().item() if same else float("inf"), tops


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--data-dir", type=Path, default=Path("/tmp/memvit-paper"))
    parser.add_argument("--train-per-class", type=int, default=200)
    parser.add_argument("--val-per-class", type=int, default=100)
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument(
        "--token-lr-scale", type=float, default=1.0, help="lr multiplier, class token + memory"
    )
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not DEIT_TINY.is_file():
        sys.exit(f"needs the real DeiT-Tiny weights at {DEIT_TINY} (set MEMVIT_SHARED_DATA)")
    pin_malloc()
    started = time.perf_counter()
    engine = deit_tiny_engine(labels=True)
    data = prepare_data(args.data_dir, args.train_per_class, args.val_per_class)
    bundles = args.data_dir / "bundles"
    bundles.mkdir(parents=True, exist_ok=True)

    results: dict[str, dict[str, dict]] = {}
    for dataset, (train_dir, val_dir) in data.items():
        for regime, overrides in REGIMES.items():
            name = f"{dataset}-{regime.replace(' + ', '-').replace(' ', '-')}"
            config = TrainConfig(
                name=name, train_dir=str(train_dir), val_dir=str(val_dir), steps=args.steps,
                batch_size=args.batch_size, lr=args.lr, token_lr_scale=args.token_lr_scale, seed=args.seed,
                workers=args.workers, **overrides,
            )  # fmt: skip
            result = train_adapter(engine, config, out=bundles / f"{name}.safetensors", progress=False)
            results.setdefault(dataset, {})[regime] = {
                "name": name,
                "top1": result.val.top1,
                "top5": result.val.top5,
                "seconds": round(result.seconds),
                "final_loss": round(result.bundle.training["final_train_loss"], 4),
            }
            print(json.dumps({"dataset": dataset, "regime": regime, **results[dataset][regime]}), flush=True)

    print(
        f"\n{args.train_per_class} training and {args.val_per_class} validation images per class, "
        f"{args.steps} steps of batch {args.batch_size}, lr {args.lr} "
        f"(x{args.token_lr_scale} for class token and memory), seed {args.seed}\n"
    )
    print("| regime | " + " | ".join(f"{d} top-1" for d in data) + " |")
    print("|---|" + "--:|" * len(data))
    for regime in REGIMES:
        print(f"| {regime} | " + " | ".join(f"{results[d][regime]['top1']:.3f}" for d in data) + " |")

    best = {d: max(r.values(), key=lambda r: r["top1"])["name"] for d, r in results.items()}
    for name in best.values():
        attach_bundle(engine, bundles / f"{name}.safetensors")
    reports = evaluate_tasks(engine, {best[d]: data[d][1] for d in data})
    diff, tops = base_predictions_unchanged(engine)
    print(f"\nOne engine serving {list(engine.adapters.names)}:")
    print("| task | fused top-1 | alone top-1 | max logit diff | unchanged |\n|---|--:|--:|--:|---|")
    for r in reports:
        print(
            f"| {r.task} | {r.fused.top1:.3f} | {r.alone.top1:.3f} | {r.max_logit_diff:.1e} | {r.unchanged} |"
        )
    print(
        f"| base (ImageNet, {len(tops)} photos, vs plain timm) | - | - | {diff:.1e} "
        f"| top-5 identical: {diff != float('inf')} |"
    )
    print("\nBase top-1 through the fused pass: " + "; ".join(tops))
    print(f"\nTotal {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
