"""The paper's Table 2, powered: four regimes on two datasets, chosen on validation, scored on a test split.

    python -m benchmarks.paper_table                                # the full table (~1.5-2 h on 2 CPU cores)
    python -m benchmarks.paper_table --datasets cifar10 --train-per-class 200 --steps 250 --seeds 0
    python -m benchmarks.paper_table --cache /tmp/memvit-paper-cache     # from activation caches

On the real DeiT-Tiny (frozen, ImageNet weights from the shared data), for CIFAR-10 (the shared
JPEGs) and Fashion-MNIST (Debian's dataset-fashion-mnist):
1. Every regime (head only, class token + head, memory 1, memory 5) at every point of its
   learning-rate grid, for every seed, trains in ONE fused run per dataset (``train_adapters``): the
   base runs once per batch for all of them. Seeds vary the adapters' initialisation (``init_seed``);
   the data order is the run's (one stream shared by every variant).
2. Per regime and seed, the grid point with the best top-1 on the validation split (cut from the
   training set, disjoint from it) is scored on the held-out test split.
3. Paired differences between regimes on the same test images, with two standard errors: over
   images (the per-image difference averaged over seeds) and over seeds (the per-seed differences).
4. The best adapter of each dataset is served together in ONE engine: each adapter's accuracy and
   the base's ImageNet predictions are unchanged.

Writes markdown for benchmarks/RESULTS.md and a learning-curve plot per dataset (--plots).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import timm
import torch

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
from benchmarks.paper_table_report import REGIMES, grid, plot_curves, report
from memvit.adapters import attach_bundle
from memvit.adapters.preprocess import eval_transform, to_rgb
from memvit.adapters.training import TrainConfig, evaluate_tasks, scan_folder, train_adapters
from memvit.adapters.training.data import ImageDataset
from memvit.memory_core import AdapterSet, LiveAdapters, MemoryViT


def prepare_data(root: Path, dataset: str, train: int, val: int, test: int) -> tuple[Path, Path, Path]:
    """train/val/test folders: val is cut from the training set after the train images (disjoint)."""
    out = root / f"{dataset}-{train}-{val}-{test}"
    if not (out / "test").is_dir():
        if dataset == "cifar10":
            train_tar = CIFAR10 / "cifar10_jpg_train_50k.tar.gz"
            cifar_tar_to_folder(train_tar, out / "train", per_class=train)
            cifar_tar_to_folder(train_tar, out / "val", per_class=val, skip_per_class=train)
            cifar_tar_to_folder(CIFAR10 / "cifar10_jpg_test_10k.tar.gz", out / "test", per_class=test)
        elif dataset == "fashion-mnist":
            images, labels = fashion_mnist_split("train")
            arrays_to_folder(images, labels, FASHION_MNIST_CLASSES, out / "train", per_class=train)
            arrays_to_folder(
                images, labels, FASHION_MNIST_CLASSES, out / "val", per_class=val, skip_per_class=train
            )
            images, labels = fashion_mnist_split("t10k")
            arrays_to_folder(images, labels, FASHION_MNIST_CLASSES, out / "test", per_class=test)
        else:
            raise ValueError(f"unknown dataset {dataset!r}")
    return out / "train", out / "val", out / "test"


@torch.inference_mode()
def test_correct(engine: MemoryViT, results: dict, test_dir: Path, batch: int) -> dict[str, torch.Tensor]:
    """Per chosen adapter, which test images it gets right (bool (N,)), from one fused pass per batch."""
    samples = scan_folder(test_dir)
    adapter_set = engine.prepare_set(r.bundle.weights for r in results.values())
    loader = torch.utils.data.DataLoader(ImageDataset(samples, eval_transform(engine)), batch_size=batch)
    correct: dict[str, list[torch.Tensor]] = {name: [] for name in results}
    for images, labels in loader:
        out = engine(images, adapter_set)
        for name in results:
            correct[name].append(out.adapters[name].argmax(-1) == labels)
    return {name: torch.cat(parts) for name, parts in correct.items()}


def base_predictions_unchanged(engine: MemoryViT, adapter_set: AdapterSet) -> float:
    """Max |logit| difference, fused pass (with ``adapter_set``) against plain timm, on the real photos
    (inf if a top-5 differs)."""
    from PIL import Image

    reference = timm.create_model("deit_tiny_patch16_224", num_classes=1000)
    reference.load_state_dict(timm.models.load_state_dict(str(DEIT_TINY)))
    reference.eval()
    transform = eval_transform(engine)
    x = torch.stack([transform(to_rgb(Image.open(p))) for p in natural_photos()])
    with torch.inference_mode():
        fused, plain = engine(x, adapter_set).base, reference(x)
    same = bool((fused.topk(5).indices == plain.topk(5).indices).all())
    return (fused - plain).abs().max().item() if same else float("inf")


def run_dataset(engine: MemoryViT, dataset: str, dirs: tuple[Path, Path, Path], args) -> dict:
    train_dir, val_dir, test_dir = dirs
    cache = {}
    if args.cache is not None:  # the base once per image and view: DIR/<dataset>-<sizes>/{train,val}
        cache = {"cache": str(args.cache / train_dir.parent.name), "cache_dtype": args.cache_dtype}
    configs, where = [], []
    for regime, overrides in REGIMES.items():
        for g, (lr, tls, mls, init) in enumerate(grid(regime, args.memory_inits)):
            for seed in args.seeds:
                name = f"{dataset}-{regime.replace(' + ', '-').replace(' ', '-')}-g{g}-s{seed}"
                configs.append(
                    TrainConfig(
                        name=name,
                        train_dir=str(train_dir),
                        val_dir=str(val_dir),
                        steps=args.steps,
                        batch_size=args.batch_size,
                        lr=lr,
                        token_lr_scale=tls,
                        memory_lr_scale=mls,
                        memory_init=init,
                        seed=args.data_seed,
                        init_seed=seed,
                        workers=args.workers,
                        eval_batch_size=128,
                        **cache,
                        **overrides,
                    )
                )
                where.append((regime, g, seed))
    started = time.perf_counter()
    results = train_adapters(engine, configs, progress=args.progress, curve_points=args.curve_points)
    seconds = time.perf_counter() - started
    # Per regime and seed: the grid point with the best validation top-1 (ties: the first).
    chosen: dict[str, dict[int, object]] = {}
    grid_val: dict[tuple[str, int], list[float]] = {}
    for (regime, g, seed), result in zip(where, results, strict=True):
        grid_val.setdefault((regime, g), []).append(result.val.top1)
        best = chosen.setdefault(regime, {}).get(seed)
        if best is None or result.val.top1 > best.val.top1:
            chosen[regime][seed] = result
    picked = {r.bundle.name: r for by_seed in chosen.values() for r in by_seed.values()}
    correct = test_correct(engine, picked, test_dir, 128)
    per_regime = {regime: [correct[chosen[regime][s].bundle.name] for s in args.seeds] for regime in REGIMES}
    return {
        "seconds": seconds,
        "variants": len(configs),
        "chosen": chosen,
        "grid_val": grid_val,
        "correct": per_regime,
        "test_images": len(next(iter(correct.values()))),
        "augmentation": results[0].augmentation,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--data-dir", type=Path, default=Path("/tmp/memvit-paper"))
    parser.add_argument("--datasets", nargs="+", default=["cifar10", "fashion-mnist"])
    parser.add_argument("--train-per-class", type=int, default=500)
    parser.add_argument("--val-per-class", type=int, default=100)
    parser.add_argument("--test-per-class", type=int, default=200)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="initialisation seeds")
    parser.add_argument("--data-seed", type=int, default=0)
    parser.add_argument("--memory-inits", nargs="+", default=["tokens"], choices=["normal", "tokens"])
    parser.add_argument("--curve-points", type=int, default=10)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--plots", type=Path, default=None, help="directory for the learning-curve PNGs")
    parser.add_argument("--progress", action="store_true")
    parser.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="activation cache root: the base runs once per image and view (original and mirror), every "
        "step reads the cache (no random crops; docs/design.md §2.9)",
    )
    parser.add_argument("--cache-dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    args = parser.parse_args(argv)
    if not DEIT_TINY.is_file():
        sys.exit(f"needs the real DeiT-Tiny weights at {DEIT_TINY} (set MEMVIT_SHARED_DATA)")
    pin_malloc()
    started = time.perf_counter()
    engine = deit_tiny_engine(labels=True)
    per_dataset = {}
    for dataset in args.datasets:
        dirs = prepare_data(
            args.data_dir, dataset, args.train_per_class, args.val_per_class, args.test_per_class
        )
        per_dataset[dataset] = run_dataset(engine, dataset, dirs, args)
        r = per_dataset[dataset]
        print(
            f"{dataset}: {r['variants']} variants in one run, {r['seconds']:.0f} s; augmentation: "
            f"{r['augmentation']}",
            flush=True,
        )
        if args.plots:
            args.plots.mkdir(parents=True, exist_ok=True)
            plot_curves(args.plots / f"paper_table_{dataset}.png", dataset, r["chosen"])
    report(per_dataset, args)
    # The concatenation claim: the best adapter of each dataset, served together in one engine.
    live = LiveAdapters(engine)
    best = {}
    for dataset, r in per_dataset.items():
        scores = {
            regime: statistics.mean(c.float().mean().item() for c in cs)
            for regime, cs in r["correct"].items()
        }
        regime = max(scores, key=scores.get)
        best[dataset] = r["chosen"][regime][args.seeds[0]]
        attach_bundle(live, best[dataset].bundle)
    test_dirs = {
        best[d].bundle.name: args.data_dir
        / f"{d}-{args.train_per_class}-{args.val_per_class}-{args.test_per_class}"
        / "test"
        for d in best
    }
    reports = evaluate_tasks(live, test_dirs)
    print(f"\nOne engine serving {list(live.current.names)} (test splits):")
    print("| task | fused top-1 | alone top-1 | max logit diff | unchanged |\n|---|--:|--:|--:|---|")
    for t in reports:
        print(
            f"| {t.task} | {t.fused.top1:.4f} | {t.alone.top1:.4f} | {t.max_logit_diff:.1e} | {t.unchanged} |"
        )
    diff = base_predictions_unchanged(engine, live.current)
    print(f"| base (ImageNet, real photos, vs plain timm) | - | - | {diff:.1e} | - |")
    print(f"\nTotal {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
