"""The paper's Table 2 from activation caches, run until validation top-1 stops rising.

    python -m benchmarks.paper_table_flat --dataset cifar10 --cache /work/cache-c10 --plots benchmarks/figures
    python -m benchmarks.paper_table_flat --dataset cifar10 --cache /work/cache-c10 --augmentation 200

On the real DeiT-Tiny (frozen), one dataset per invocation (its caches fit this machine's disk one at
a time). The regimes, grids, stopping rule and choice are in benchmarks/table2.py, the test pass, the
curves and the tables in benchmarks/paper_table_flat_report.py:
1. Every regime (head only, class token + head, memory 1, 5, 10) at every point of its grid
   (``table2.GRID``: ``paper_table_report.GRIDS``, memory 10 as memory 5), for every seed, trains in ONE
   fused run over the activation cache (``TrainingRun``). Head only and class token + head start
   from the base's class token and a zero head, so their seeds are the same run: they train once
   and stand for every seed.
2. After every epoch every variant is scored on the validation split (cut from the training set,
   disjoint) from its cache. The run stops when every variant has plateaued (``plateaued``: the last
   ``--patience`` epochs gained less than ``--min-gain`` over the best epoch before them), but not
   before the schedule's last quarter (``first_stop``), or at ``--epochs`` (the warm-up/cosine
   schedule spans the cap). Each variant keeps its best epoch.
3. Per regime and seed, the grid point with the best validation top-1 (at its best epoch) is scored
   on the test split (uncached; one fused pass for every chosen adapter); paired differences with
   standard errors over images and over seeds (``paper_table_report.paired``).
With ``--augmentation N`` the same regimes (first grid point) also train on the first N images per
class three ways: from a cache with no augmentation, from a cache of original + mirror views (mirror
with p=0.5), and from the images with random-resized crops + flips (no cache; ``--no-uncached``
skips it), validated and tested on the same splits, the test pass shared with the main run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

from benchmarks.common import argument_parser, deit_tiny_engine, pin_malloc
from benchmarks.paper_table import prepare_data
from benchmarks.paper_table_flat_report import plot, report, test_correct
from benchmarks.table2 import GRID, REGIMES, Arm, Trained, choose, first_stop, grid_points, plateaued, seeded
from memvit.adapters.preprocess import eval_transform
from memvit.adapters.training import TrainConfig, TrainingRun, evaluate_many
from memvit.memory_core import MemoryViT


def train_arm(engine: MemoryViT, dataset: str, arm: Arm, val_dir: Path, args, val_cache=None) -> dict:
    """Every regime x grid point x seed of ``arm`` in one fused run, epoch by epoch to the plateau."""
    points = {r: GRID[r][: grid_points(r, args, arm)] for r in REGIMES}
    where, configs = [], []
    for regime, overrides in REGIMES.items():
        for g, (lr, tls, mls) in enumerate(points[regime]):
            for seed in args.seeds if seeded(regime) else args.seeds[:1]:
                slug = regime.replace(" + ", "-").replace(" ", "-")
                cache = {}
                if arm.cache is not None:
                    cache = {
                        "cache": str(arm.cache),
                        "cache_dtype": args.cache_dtype,
                        "cache_views": arm.views,
                    }
                configs.append(
                    TrainConfig(
                        name=f"{dataset}-{slug}-g{g}-s{seed}",
                        train_dir=str(arm.train_dir),
                        val_dir=str(val_dir),
                        epochs=args.epochs,
                        batch_size=args.batch_size,
                        lr=lr,
                        token_lr_scale=tls,
                        memory_lr_scale=mls,
                        hflip=arm.hflip,
                        seed=args.data_seed,
                        init_seed=seed,
                        workers=0 if arm.cache is not None else 1,
                        eval_batch_size=128,
                        **cache,
                        **overrides,
                    )
                )
                where.append((regime, g, seed))
    started = time.perf_counter()
    run = TrainingRun(engine, configs, progress=False)  # builds or opens the caches
    build_s = time.perf_counter() - started
    val_cache = run.val_cache or val_cache
    per_epoch = math.ceil(len(run.train_samples) / args.batch_size)
    trained = [
        Trained(r, g, s, [], 0, run.variants[i].adapter.weights()) for i, (r, g, s) in enumerate(where)
    ]
    epoch_s, val_s = [], []
    print(
        f"[{arm.name}] {len(configs)} variants, {len(run.train_samples)} training images "
        f"({run.augmentation}), caches ready in {build_s:.0f} s",
        flush=True,
    )
    for epoch in range(1, args.epochs + 1):
        started = time.perf_counter()
        run.run(until=epoch * per_epoch)
        epoch_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        weights = [v.adapter.weights() for v in run.variants]
        accs = evaluate_many(
            engine, weights, run.val_samples, eval_transform(engine), batch_size=128, cache=val_cache
        )
        val_s.append(time.perf_counter() - started)
        for t, w, acc in zip(trained, weights, accs, strict=True):
            t.curve.append(acc.top1)
            t.last = w
            if acc.top1 > max(t.curve[:-1], default=-1.0):
                t.best_epoch, t.weights = epoch, w
        flat = sum(plateaued(t.curve, args.patience, args.min_gain) for t in trained)
        print(
            f"[{arm.name}] epoch {epoch}: {epoch_s[-1]:.0f} s training, {val_s[-1]:.0f} s validation; "
            f"val top-1 {min(t.curve[-1] for t in trained):.4f}-{max(t.curve[-1] for t in trained):.4f}; "
            f"plateaued {flat}/{len(trained)}",
            flush=True,
        )
        if flat == len(trained) and epoch >= first_stop(args.epochs):
            break
    return {
        "arm": arm,
        "trained": trained,
        "augmentation": run.augmentation,
        "train_images": len(run.train_samples),
        "build_s": build_s,
        "epoch_s": epoch_s,
        "val_s": val_s,
        "val_cache": val_cache,
    }


def subset_folder(source: Path, out: Path, per_class: int) -> Path:
    """The first ``per_class`` images of each class of ``source``, hard-linked under ``out``."""
    if not out.is_dir():
        building = out.with_name(out.name + ".building")
        for folder in sorted(p for p in source.iterdir() if p.is_dir()):
            (building / folder.name).mkdir(parents=True, exist_ok=True)
            for f in sorted(folder.iterdir())[:per_class]:
                (building / folder.name / f.name).hardlink_to(f)
        building.rename(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--dataset", default="cifar10", choices=["cifar10", "fashion-mnist"])
    parser.add_argument("--data-dir", type=Path, default=Path("/tmp/memvit-paper"))
    parser.add_argument("--cache", type=Path, required=True, help="activation cache root (outside the repo)")
    parser.add_argument("--cache-dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--train-per-class", type=int, default=2000)
    parser.add_argument("--val-per-class", type=int, default=200)
    parser.add_argument("--test-per-class", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=10, help="the cap")
    parser.add_argument("--patience", type=int, default=2)
    parser.add_argument("--min-gain", type=float, default=0.001, help="top-1 fraction (0.001 = 0.1 point)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--data-seed", type=int, default=0)
    parser.add_argument("--grid-points", type=int, default=2, help="the first N points of each regime's grid")
    parser.add_argument("--memory-grid-points", type=int, default=None, help="the same for memory regimes")
    parser.add_argument(
        "--augmentation",
        type=int,
        default=None,
        metavar="PER_CLASS",
        help="also compare none / mirror / uncached on this many training images per class (first grid "
        "point of each regime)",
    )
    parser.add_argument(
        "--no-uncached", action="store_true", help="with --augmentation: skip the uncached arm"
    )
    parser.add_argument("--no-main", action="store_true", help="with --augmentation: only the subset arms")
    parser.add_argument("--plots", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="write the summary here")
    args = parser.parse_args(argv)
    pin_malloc()
    started = time.perf_counter()
    engine = deit_tiny_engine()
    train_dir, val_dir, test_dir = prepare_data(
        args.data_dir, args.dataset, args.train_per_class, args.val_per_class, args.test_per_class
    )
    arms = [Arm("cached, no augmentation", train_dir, args.cache, views=1, hflip=0.0)]
    if args.augmentation and args.no_main:
        arms = []
    if args.augmentation:
        n = args.augmentation
        sub = subset_folder(train_dir, train_dir.with_name(f"train-{n}"), n)
        cache = args.cache.with_name(f"{args.cache.name}-augmentation")  # two views
        arms += [
            Arm(f"subset {n}/class: cached, no augmentation", sub, cache, views=2, hflip=0.0, grid_points=1),
            Arm(
                f"subset {n}/class: cached, original + mirror", sub, cache, views=2, hflip=0.5, grid_points=1
            ),
        ]
        if not args.no_uncached:
            arms.append(
                Arm(f"subset {n}/class: uncached, crops + flips", sub, None, hflip=0.5, grid_points=1)
            )
    results: dict[str, dict] = {}
    val_cache = None
    for arm in arms:
        results[arm.name] = train_arm(engine, args.dataset, arm, val_dir, args, val_cache)
        val_cache = results[arm.name]["val_cache"]
        results[arm.name]["chosen"] = choose(results[arm.name]["trained"], args.seeds)
    # Every chosen adapter of every arm in one test pass (names made unique per arm), at its best
    # epoch and at the last epoch run: the second compares regimes with no choice of epoch at all.
    weights, test_start = [], time.perf_counter()
    for i, r in enumerate(results.values()):
        for by_seed in r["chosen"].values():
            for t in by_seed.values():
                if not t.weights.name.endswith(f"-a{i}"):
                    t.weights = dataclasses.replace(t.weights, name=f"{t.weights.name}-a{i}")
                    t.last = dataclasses.replace(t.last, name=f"{t.last.name}-last-a{i}")
                    weights += [t.weights, t.last]
    correct = test_correct(engine, weights, test_dir)
    test_s = time.perf_counter() - test_start
    summary = report(args.dataset, results, correct, args)
    total = time.perf_counter() - started
    print(f"\nTest pass ({len(weights)} adapters, one fused pass): {test_s:.0f} s; total {total:.0f} s")
    if args.plots:
        args.plots.mkdir(parents=True, exist_ok=True)
        name = f"paper_table_flat_{args.dataset}{'_augmentation' if args.no_main else ''}.png"
        plot(args.plots / name, args.dataset, results)
    if args.json:
        summary.update(
            curves={arm: {t.weights.name: t.curve for t in r["trained"]} for arm, r in results.items()},
            test_s=test_s,
            total_s=total,
        )
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
