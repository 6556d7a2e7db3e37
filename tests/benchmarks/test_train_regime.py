"""The end-to-end regime the GPU suite compares with the CPU (benchmarks/train_regime.py): its data
cut is disjoint and the same every time, and its record is the regime it says."""

from __future__ import annotations

import json

import pytest

from benchmarks.train_regime import RECORD, TARBALL, Regime, agreement, cut


def test_agreement_is_the_share_predicted_alike() -> None:
    assert agreement([1, 2, 3, 4], [1, 2, 0, 4]) == 0.75
    with pytest.raises(ValueError):
        agreement([1], [1, 2])


@pytest.mark.skipif(not TARBALL.is_file(), reason=f"{TARBALL} not found (../shared/data is absent)")
def test_the_cut_is_disjoint_balanced_and_repeatable(tmp_path) -> None:
    regime = Regime(train_per_class=3, val_per_class=2)
    first = cut(tmp_path / "a", regime)
    again = cut(tmp_path / "b", regime)
    names = {}
    for part, per_class in (("train", 3), ("val", 2)):
        classes = sorted(p.name for p in (first / part).iterdir())
        assert len(classes) == 10
        files = {c: sorted(p.name for p in (first / part / c).iterdir()) for c in classes}
        assert all(len(f) == per_class for f in files.values())
        assert files == {c: sorted(p.name for p in (again / part / c).iterdir()) for c in classes}
        names[part] = {(c, f) for c, fs in files.items() for f in fs}
    assert not names["train"] & names["val"]


def test_the_cpu_record_is_of_the_regime_it_compares() -> None:
    if not RECORD.is_file():
        pytest.skip(f"{RECORD.name} not recorded yet")
    record = json.loads(RECORD.read_text())
    assert record["regime"] == Regime().__dict__
    assert len(record["predictions"]) == record["val_images"] == 10 * Regime().val_per_class
    assert 0.0 < record["val_top1"] <= 1.0 and record["device"] == "cpu"
