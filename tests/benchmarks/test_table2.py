"""The stopping rule and the choice of grid points of the Table 2 run (benchmarks/table2.py)."""

from __future__ import annotations

import math

import pytest

from benchmarks.table2 import Trained, choose, first_stop, plateaued


@pytest.mark.parametrize(
    ("curve", "flat"),
    [
        ([], False),
        ([0.5, 0.5], False),  # not enough epochs to judge
        ([0.5, 0.6, 0.7], False),  # still rising
        ([0.5, 0.7, 0.7005, 0.7009], True),  # gains under 0.1 point for 2 epochs
        ([0.5, 0.7, 0.69, 0.702], False),  # the last epoch gained 0.2 point
        ([0.5, 0.7, 0.65, 0.66], True),  # fell after its best
        ([0.5, 0.7, 0.8, 0.6], False),  # the best is inside the window
    ],
)
def test_plateaued(curve, flat):
    assert plateaued(curve, patience=2, min_gain=0.001) is flat


def test_plateaued_needs_patience():
    assert not plateaued([0.5, 0.5, 0.5], patience=0, min_gain=0.001)
    assert plateaued([0.5, 0.5], patience=1, min_gain=0.001)


def _t(regime: str, grid: int, seed: int, curve: list[float]) -> Trained:
    return Trained(regime, grid, seed, curve, curve.index(max(curve)) + 1, weights=None)


def test_choose_best_grid_point_per_seed_at_its_best_epoch():
    runs = [
        _t("memory 1", 0, 0, [0.6, 0.8, 0.7]),
        _t("memory 1", 1, 0, [0.75, 0.79]),
        _t("memory 1", 0, 1, [0.6, 0.7]),
        _t("memory 1", 1, 1, [0.72, 0.71]),
        _t("head only", 0, 0, [0.5, 0.6]),
        _t("head only", 1, 0, [0.65, 0.6]),
    ]
    chosen = choose(runs, [0, 1])
    assert chosen["memory 1"][0] is runs[0] and chosen["memory 1"][1] is runs[3]
    # head only's seeds are one run: it stands for every seed
    assert chosen["head only"][0] is runs[5] and chosen["head only"][1] is runs[5]


@pytest.mark.parametrize(("cap", "first"), [(1, 1), (4, 3), (10, 8), (20, 15)])
def test_a_run_may_stop_only_in_its_schedules_last_quarter(cap, first):
    # cosine factor 0.5 * (1 + cos(pi * epoch / cap)) is below 0.15 from epoch ``first`` on, not before
    assert first_stop(cap) == first
    factor = lambda e: 0.5 * (1 + math.cos(math.pi * e / cap))  # noqa: E731
    assert factor(first) < 0.15 and (first == 1 or factor(first - 1) >= 0.15)
