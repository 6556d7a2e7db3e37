"""The benchmarks' shared module, and the benchmarks importing as modules of one package."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.build_demo import portable_training
from benchmarks.common import REPO, argument_parser, interleaved, median_ratio


def test_median_ratio_pairs_rounds() -> None:
    times = {"a": [2.0, 3.0, 100.0], "b": [1.0, 1.0, 1.0]}
    assert median_ratio(times, "a", "b") == 3.0
    assert median_ratio(times, "a", "missing") is None


def test_interleaved_warms_up_then_times_every_round() -> None:
    calls: list[str] = []
    times = interleaved({"x": lambda: calls.append("x"), "y": lambda: calls.append("y")}, rounds=2)
    assert calls == ["x", "y"] * 3
    assert {k: len(v) for k, v in times.items()} == {"x": 2, "y": 2}


def test_shared_data_honours_the_environment(tmp_path) -> None:
    code = "from benchmarks.common import SHARED_DATA, DEIT_TINY; print(SHARED_DATA); print(DEIT_TINY)"
    env = {**os.environ, "MEMVIT_SHARED_DATA": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert Path(out[0]) == tmp_path and Path(out[1]).is_relative_to(tmp_path)


@pytest.mark.parametrize(
    "name", ["fused", "train_step", "paper_table", "serve", "build_demo", "batch_invariance"]
)
def test_benchmarks_import_as_modules(name) -> None:
    module = importlib.import_module(f"benchmarks.{name}")
    assert callable(module.main)
    assert argument_parser(module.__file__, module.__doc__).prog == f"python -m benchmarks.{name}"


def test_demo_metadata_records_relative_data_folders() -> None:
    training = {
        "data": {"train_dir": "/tmp/x1/digits/train", "val_dir": "/tmp/x1/digits/val", "classes": ["0"]},
        "steps": 3,
    }
    portable = portable_training(training, Path("/tmp/x1"), "mnist")
    assert portable["data"] == {
        "dataset": "mnist",
        "train_dir": "digits/train",
        "val_dir": "digits/val",
        "classes": ["0"],
    }
    assert portable["steps"] == 3 and portable["source"] == "benchmarks/build_demo.py"
