"""The Table 2 run's report (benchmarks/paper_table_flat.py): the test pass, the curves and the tables."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import torch

from benchmarks.paper_table_report import paired
from benchmarks.table2 import GRID, PAIRS, REGIMES, first_stop, grid_points
from memvit.adapters.preprocess import eval_transform
from memvit.adapters.training import scan_folder
from memvit.adapters.training.data import ImageDataset
from memvit.memory_core import AdapterWeights, MemoryViT


@torch.inference_mode()
def test_correct(engine: MemoryViT, weights: list[AdapterWeights], test_dir: Path) -> dict[str, torch.Tensor]:
    """Which test images each adapter gets right (bool (N,)), from one fused pass per batch."""
    samples = scan_folder(test_dir, check_images=False)
    adapter_set = engine.prepare_set(weights)
    dataset = ImageDataset(samples, eval_transform(engine))
    loader = torch.utils.data.DataLoader(dataset, batch_size=128, num_workers=1)
    correct: dict[str, list[torch.Tensor]] = {w.name: [] for w in weights}
    for images, labels in loader:
        out = engine(images, adapter_set)
        for name in correct:
            correct[name].append(out.adapters[name].argmax(-1) == labels)
    return {name: torch.cat(parts) for name, parts in correct.items()}


def plot(path: Path, title: str, arms: dict[str, dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        1, len(arms), figsize=(6.5 * len(arms), 4.6), constrained_layout=True, squeeze=False
    )
    for ax, (arm, r) in zip(axes[0], arms.items(), strict=True):
        for i, regime in enumerate(REGIMES):
            picked = {id(t) for t in r["chosen"][regime].values()}
            for t in r["trained"]:
                if t.regime != regime:
                    continue
                on = id(t) in picked
                first = on and t is next(iter(r["chosen"][regime].values()))
                epochs = range(1, len(t.curve) + 1)
                ax.plot(
                    epochs,
                    t.curve,
                    color=f"C{i}",
                    linewidth=1.2 if on else 0.6,
                    linestyle="-" if on else ":",
                    marker="o" if on else None,
                    markersize=2.5,
                    label=regime if first else None,
                )
        ax.set(title=f"{title}: {arm}", xlabel="epoch", ylabel="validation top-1")
        ax.legend(fontsize=8)
    fig.suptitle("chosen grid point per seed: solid; other grid points: dotted", fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(dataset: str, arms: dict[str, dict], correct: dict[str, torch.Tensor], args) -> dict:
    seeds = args.seeds
    per_arm = {
        arm: {regime: [correct[r["chosen"][regime][s].weights.name] for s in seeds] for regime in REGIMES}
        for arm, r in arms.items()
    }
    n_test = len(next(iter(correct.values())))
    print(f"\n{dataset}: test top-1 on {n_test} images (mean ± sd over seeds {seeds}); epochs to the best")
    print("| regime | " + " | ".join(f"{a} top-1 | best epoch" for a in arms) + " |")
    print("|---|" + "--:|--:|" * len(arms))
    summary: dict = {"test_images": n_test, "arms": {}}
    for regime in REGIMES:
        cells = []
        for arm, r in arms.items():
            accs = [c.float().mean().item() for c in per_arm[arm][regime]]
            sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
            best_epochs = sorted({t.best_epoch for t in r["chosen"][regime].values()})
            cells.append(f"{statistics.mean(accs):.4f} ± {sd:.4f} | {','.join(map(str, best_epochs))}")
            summary["arms"].setdefault(arm, {})[regime] = accs
        print(f"| {regime} | " + " | ".join(cells) + " |")
    for arm, r in arms.items():
        ran = len(r["epoch_s"])
        print(
            f"\n[{arm}] {r['train_images']} training images, {r['augmentation']}; "
            f"{len(r['trained'])} variants; ran {ran} of {args.epochs} epochs (stop: every variant's last "
            f"{args.patience} epochs gained < {args.min_gain * 100:g} point over its best before, from epoch "
            f"{first_stop(args.epochs)}); caches "
            f"{r['build_s']:.0f} s, epochs {statistics.median(r['epoch_s']):.0f} s (median) + validation "
            f"{statistics.median(r['val_s']):.0f} s"
        )
        print("Validation top-1 per grid point (lr, class-token scale, memory scale), best epoch, seed mean:")
        for regime in REGIMES:
            cells = []
            for g, point in enumerate(GRID[regime][: grid_points(regime, args, r["arm"])]):
                vals = [t.best for t in r["trained"] if t.regime == regime and t.grid == g]
                cells.append(f"{point}: {statistics.mean(vals):.4f}")
            picks = [f"g{r['chosen'][regime][s].grid}" for s in seeds]
            print(f"- {regime}: {'; '.join(cells)}; chosen {picks}")
        summary["arms"][arm]["_epochs"] = {"ran": ran, "train_s": r["epoch_s"], "val_s": r["val_s"]}
    last = {
        arm: {regime: [correct[r["chosen"][regime][s].last.name] for s in seeds] for regime in REGIMES}
        for arm, r in arms.items()
        if all(t.last and t.last.name in correct for by in r["chosen"].values() for t in by.values())
    }
    if last:
        _print_last(last, summary)
    print("\nPaired differences on the same test images (points of top-1; SE over images | over seeds):")
    print("| arm | comparison | difference | SE images | SE seeds | per seed | >= 2 SE |")
    print("|---|---|--:|--:|--:|---|---|")
    comparisons = [(arm, arm, a, b) for arm in arms for a, b in PAIRS]
    subset = [name for name in arms if name.startswith("subset")]  # augmentation against none
    comparisons += [(f"{x} - {subset[0]}", (x, subset[0]), r, r) for x in subset[1:] for r in REGIMES]
    for label, which, a, b in comparisons:
        left, right = (which, which) if isinstance(which, str) else which
        what = f"{a} - {b}" if a != b else a
        print(f"| {label} | {what} | {_paired_cells(per_arm[left][a], per_arm[right][b])} |")
    return summary


def _print_last(last: dict[str, dict[str, list[torch.Tensor]]], summary: dict) -> None:
    """The chosen grid points scored at the last epoch run: the regimes compared with no choice of
    epoch, so a regime whose validation peaked early on a noisy split is not judged by that epoch."""
    print("\nAt the last epoch run (each regime's chosen grid point; no choice of epoch): test top-1")
    print("| arm | regime | top-1 (mean ± sd over seeds) |")
    print("|---|---|--:|")
    for arm, by_regime in last.items():
        accs = {regime: [c.float().mean().item() for c in cs] for regime, cs in by_regime.items()}
        summary.setdefault("last", {})[arm] = accs
        for regime, values in accs.items():
            sd = statistics.stdev(values) if len(values) > 1 else 0.0
            print(f"| {arm} | {regime} | {statistics.mean(values):.4f} ± {sd:.4f} |")
    print("| arm | comparison at the last epoch | difference | SE images | SE seeds | per seed | >= 2 SE |")
    print("|---|---|--:|--:|--:|---|---|")
    for arm, by_regime in last.items():
        for a, b in PAIRS:
            print(f"| {arm} | {a} - {b} | {_paired_cells(by_regime[a], by_regime[b])} |")


def _paired_cells(left: list[torch.Tensor], right: list[torch.Tensor]) -> str:
    """A paired comparison's cells: difference, SE over images, SE over seeds, per seed, >= 2 SE."""
    p = paired(left, right)
    se = max(p["se_images"], 0.0 if math.isnan(p["se_seeds"]) else p["se_seeds"])
    separated = "yes" if p["diff"] and abs(p["diff"]) >= 2 * se else "no"
    seeds_s = ", ".join(f"{100 * x:+.2f}" for x in p["per_seed"])
    return (
        f"{100 * p['diff']:+.2f} | {100 * p['se_images']:.2f} | {100 * p['se_seeds']:.2f} "
        f"| {seeds_s} | {separated}"
    )
