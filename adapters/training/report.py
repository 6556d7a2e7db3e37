"""The sweep report: a table (Markdown and JSON) of every variant, and its learning curves as a PNG.

The plot needs matplotlib (``pip install 'memvit[train]'``); without it the report is written
without the picture and says so once in the log.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from .results import SweepResult

log = logging.getLogger(__name__)


def _smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` values (the training loss is one batch's: noisy)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def write_report(result: SweepResult, out_dir: Path) -> list[Path]:
    """Write sweep.json, sweep.md and (with matplotlib) sweep.png into ``out_dir``; returns them."""
    rows = []
    for i, v in enumerate(result.variants):
        r = v.result
        rows.append(
            {
                "variant": v.config.name,
                "chosen": i == result.best,
                "overrides": v.overrides,
                "val_top1": r.val.top1,
                "val_top5": r.val.top5,
                "val_images": r.val.images,
                "final_train_loss": sum(r.losses[-20:]) / max(1, len(r.losses[-20:])),
                "steps": r.steps,
                "augmentation": r.augmentation,
                "curve": r.curve,
                "bundle": f"{v.config.name}.safetensors",
            }
        )
    paths = [out_dir / "sweep.json", out_dir / "sweep.md"]
    paths[0].write_text(json.dumps({"variants": rows}, indent=2) + "\n", encoding="utf-8")
    keys = list(result.variants[0].overrides)
    lines = [
        f"# Sweep: {len(rows)} variants, {rows[0]['steps']} steps, one run",
        "",
        f"Chosen on validation top-1 ({rows[0]['val_images']} images): **{result.chosen.config.name}**, "
        "also written under the run's own name. Its validation score is the one it was chosen on: "
        "score it on held-out data before quoting it.",
        "",
        f"Augmentation: {result.chosen.result.augmentation or 'not recorded'}.",
        "",
        "| variant | " + " | ".join(keys) + " | val top-1 | val top-5 | final train loss |",
        "|---|" + "---:|" * (len(keys) + 3),
    ]
    for row in rows:
        mark = " (chosen)" if row["chosen"] else ""
        values = " | ".join(str(row["overrides"][k]) for k in keys)
        lines.append(
            f"| {row['variant']}{mark} | {values} | {row['val_top1']:.4f} | {row['val_top5']:.4f} "
            f"| {row['final_train_loss']:.4f} |"
        )
    if (png := _plot(result, out_dir / "sweep.png")) is not None:
        lines += ["", "![learning curves](sweep.png)"]
        paths.append(png)
    paths[1].write_text("\n".join(lines) + "\n", encoding="utf-8")
    return paths


def _plot(result: SweepResult, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: the sweep report has no plot (pip install 'memvit[train]')")
        return None
    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(12, 4.8), constrained_layout=True)
    steps = result.variants[0].result.steps
    window = max(1, steps // 20)
    for i, v in enumerate(result.variants):
        r = v.result
        style = {"linewidth": 2.4 if i == result.best else 1.2, "label": v.config.name}
        loss_ax.plot(range(1, len(r.losses) + 1), _smooth(r.losses, window), **style)
        if r.curve:
            acc_ax.plot([s for s, _ in r.curve], [a for _, a in r.curve], marker="o", markersize=3, **style)
    loss_ax.set(title=f"training loss (mean of {window} steps)", xlabel="step", ylabel="cross-entropy")
    acc_ax.set(title="validation top-1", xlabel="step", ylabel="top-1")
    acc_ax.legend(fontsize=7, loc="lower right")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
