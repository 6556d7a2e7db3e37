"""The paper's Table 2 (benchmarks/paper_table.py): the regimes and their learning-rate grids, and
what the run reports of them: paired differences on the same test images, the markdown tables and
the learning-curve plots."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import torch

# Each regime's grid: (lr, class-token lr scale, memory lr scale). The class token needs ~30x the
# head's step (its gradient is ~0.25% of its norm, RESULTS §2.5); memory regimes also try each
# --memory-inits.
REGIMES: dict[str, dict] = {
    "head only": {"head_only": True},
    "class token + head": {"memory_tokens": 0},
    "memory 1": {"memory_tokens": 1},
    "memory 5": {"memory_tokens": 5},
}


GRIDS: dict[str, list[tuple[float, float, float]]] = {
    "head only": [(0.05, 1, 1), (0.2, 1, 1)],
    "class token + head": [(0.05, 30, 1), (0.05, 100, 1)],
    "memory 1": [(0.05, 30, 1), (0.05, 30, 10)],
    "memory 5": [(0.05, 30, 1), (0.05, 30, 10)],
}


def grid(regime: str, inits: list[str]) -> list[tuple[float, float, float, str]]:
    """The regime's grid points, each with a memory initialisation (memory regimes: every one of inits)."""
    points = GRIDS[regime]
    if REGIMES[regime].get("memory_tokens"):
        return [(*p, init) for init in inits for p in points]
    return [(*p, "normal") for p in points]


def paired(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict[str, float]:
    """Regime a minus regime b on the same images, per seed: mean, SE over images, SE over seeds."""
    per_seed = [float(x.float().mean() - y.float().mean()) for x, y in zip(a, b, strict=True)]
    per_image = torch.stack([x.float() - y.float() for x, y in zip(a, b, strict=True)]).mean(0)
    se_images = float(per_image.std()) / math.sqrt(per_image.numel())
    se_seeds = statistics.stdev(per_seed) / math.sqrt(len(per_seed)) if len(per_seed) > 1 else float("nan")
    return {
        "diff": sum(per_seed) / len(per_seed),
        "se_images": se_images,
        "se_seeds": se_seeds,
        "per_seed": per_seed,
    }


def plot_curves(path: Path, dataset: str, chosen: dict[str, dict[int, object]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from memvit.adapters.training.report import _smooth

    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(12, 4.6), constrained_layout=True)
    for i, (regime, by_seed) in enumerate(chosen.items()):
        colour = f"C{i}"
        for j, result in enumerate(by_seed.values()):
            label = regime if j == 0 else None
            loss_ax.plot(_smooth(result.losses, 50), color=colour, linewidth=1, label=label)
            acc_ax.plot(*zip(*result.curve, strict=True), color=colour, marker="o", markersize=2, label=label)
    loss_ax.set(title=f"{dataset}: training loss (mean of 50 steps)", xlabel="step", ylabel="cross-entropy")
    acc_ax.set(title=f"{dataset}: validation top-1 (chosen grid point, each seed)", xlabel="step")
    acc_ax.legend()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(per_dataset: dict, args) -> None:
    print(
        f"\n{args.train_per_class} training, {args.val_per_class} validation (for choosing) and "
        f"{args.test_per_class} test images per class; {args.steps} steps of batch {args.batch_size}; "
        f"initialisation seeds {args.seeds}; memory inits {args.memory_inits}\n"
    )
    datasets = list(per_dataset)
    print("| regime | " + " | ".join(f"{d} test top-1 (mean ± sd over seeds)" for d in datasets) + " |")
    print("|---|" + "--:|" * len(datasets))
    for regime in REGIMES:
        cells = []
        for d in datasets:
            accs = [c.float().mean().item() for c in per_dataset[d]["correct"][regime]]
            sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
            cells.append(f"{statistics.mean(accs):.4f} ± {sd:.4f}")
        print(f"| {regime} | " + " | ".join(cells) + " |")
    print(
        "\nGrid (lr, class-token scale, memory scale) -> mean validation top-1 over seeds; chosen per seed:"
    )
    for d in datasets:
        r = per_dataset[d]
        for regime in REGIMES:
            points = [
                f"{point}: {statistics.mean(r['grid_val'][(regime, g)]):.4f}"
                for g, point in enumerate(grid(regime, args.memory_inits))
            ]
            picks = [r["chosen"][regime][s].bundle.name.rsplit("-", 2)[-2] for s in args.seeds]
            print(f"- {d}, {regime}: {'; '.join(points)}; chosen {picks}")
    print("\nPaired differences on the same test images (test top-1 points; SE over images | over seeds):")
    print("| dataset | comparison | difference | SE images | SE seeds | per seed | >= 2 SE (larger) |")
    print("|---|---|--:|--:|--:|---|---|")
    pairs = [
        ("memory 5", "head only"),
        ("memory 5", "class token + head"),
        ("memory 1", "head only"),
        ("memory 1", "class token + head"),
        ("class token + head", "head only"),
        ("memory 5", "memory 1"),
    ]
    for d in datasets:
        correct = per_dataset[d]["correct"]
        for a, b in pairs:
            p = paired(correct[a], correct[b])
            se = max(p["se_images"], 0.0 if math.isnan(p["se_seeds"]) else p["se_seeds"])
            seeds = ", ".join(f"{x:+.4f}" for x in p["per_seed"])
            print(
                f"| {d} | {a} - {b} | {p['diff']:+.4f} | {p['se_images']:.4f} | {p['se_seeds']:.4f} "
                f"| {seeds} | {'yes' if p['diff'] > 0 and p['diff'] >= 2 * se else 'no'} |"
            )
    print(
        json.dumps(
            {d: {"seconds": round(r["seconds"]), "variants": r["variants"]} for d, r in per_dataset.items()}
        )
    )
