"""The Table 2 run's report (benchmarks/paper_table_flat_report.py): test top-1 at the chosen epoch and,
with no choice of epoch, at the last epoch run."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks.paper_table_flat_report import report
from benchmarks.table2 import REGIMES, Arm, Trained, choose, seeded

SEEDS = [0, 1, 2]
ARM = "cached, no augmentation"


def _arm(with_last: bool) -> tuple[dict, dict[str, torch.Tensor]]:
    """One grid point per regime; each variant's test answers at its best and at its last epoch."""
    g = torch.Generator().manual_seed(0)
    trained, correct = [], {}
    for r, regime in enumerate(REGIMES):
        for seed in SEEDS if seeded(regime) else SEEDS[:1]:
            best, last = f"{r}-{seed}-best", f"{r}-{seed}-last"
            correct[best] = torch.rand(400, generator=g) < 0.5 + 0.05 * r
            correct[last] = torch.rand(400, generator=g) < 0.8 - 0.05 * r  # the order reversed
            curve = [0.5, 0.6 + 0.01 * r, 0.6]
            trained.append(
                Trained(
                    regime,
                    0,
                    seed,
                    curve,
                    2,
                    SimpleNamespace(name=best),
                    SimpleNamespace(name=last) if with_last else None,
                )
            )
    r = {
        "arm": Arm(ARM, Path("train"), Path("cache"), grid_points=1),
        "trained": trained,
        "chosen": choose(trained, SEEDS),
        "augmentation": "cached views: original, centre crop",
        "train_images": 400,
        "build_s": 1.0,
        "epoch_s": [1.0, 1.0, 1.0],
        "val_s": [0.1, 0.1, 0.1],
    }
    return {ARM: r}, correct


def _args() -> SimpleNamespace:
    return SimpleNamespace(
        seeds=SEEDS, epochs=3, patience=2, min_gain=0.001, grid_points=1, memory_grid_points=1
    )


def test_the_last_epoch_is_scored_beside_the_chosen_one(capsys) -> None:
    arms, correct = _arm(with_last=True)
    summary = report("cifar10", arms, correct, _args())
    out = capsys.readouterr().out
    assert "At the last epoch run" in out
    for regime, accs in summary["last"][ARM].items():
        chosen = arms[ARM]["chosen"][regime]
        assert accs == pytest.approx([correct[chosen[s].last.name].float().mean().item() for s in SEEDS])
        assert summary["arms"][ARM][regime] == pytest.approx(
            [correct[chosen[s].weights.name].float().mean().item() for s in SEEDS]
        )
    # The two orders differ, so the two tables must too: head only is last at the chosen epoch, first
    # at the last epoch.
    first, last = summary["arms"][ARM], summary["last"][ARM]
    assert sum(first["head only"]) < sum(first["memory 10"]) and sum(last["head only"]) > sum(
        last["memory 10"]
    )
    assert "| cached, no augmentation | memory 10 - head only |" in out


def test_a_run_without_last_epoch_weights_reports_the_chosen_epoch_only(capsys) -> None:
    arms, correct = _arm(with_last=False)
    summary = report("cifar10", arms, correct, _args())
    assert "last" not in summary and "At the last epoch run" not in capsys.readouterr().out
