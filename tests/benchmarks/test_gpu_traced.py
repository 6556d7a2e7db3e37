"""A GPU-suite row that failed says where (benchmarks/gpu/traced.py): the innermost frames of its
traceback and what it was raised from, beside the error's last line."""

from __future__ import annotations

from pathlib import Path

from benchmarks.gpu.report import StepReport
from benchmarks.gpu.traced import traced, where


def _capture() -> None:
    raise RuntimeError("CUDA error: operation failed due to a previous error during capture")


def _evaluate() -> dict:
    try:
        _capture()
    except RuntimeError as exc:
        raise ValueError("the run failed") from exc
    return {}


def test_a_failed_row_keeps_where_it_failed(tmp_path: Path) -> None:
    env = {"cpu": "x", "torch_threads": 1, "torch": "t", "timm": "t"}
    report = StepReport(tmp_path, "training", env, {})
    assert not report.attempt("t", {"precision": "float32"}, traced(_evaluate))
    (row,) = report.tables["t"]
    assert row["error"] == "ValueError: the run failed" and row["precision"] == "float32"
    here = "tests/benchmarks/test_gpu_traced.py"
    assert f"{here}:" in row["where"] and "_evaluate" in row["where"]
    assert "raised from RuntimeError" in row["where"] and "_capture" in row["where"]
    assert "during capture" in row["where"] and "where" in (tmp_path / "training.md").read_text()
    assert report.attempt("t", {}, traced(lambda: {"x": 1}))  # a row that works is untouched
    assert report.tables["t"][1] == {"x": 1, "s": report.tables["t"][1]["s"]}


def test_where_keeps_the_innermost_frames_outermost_first() -> None:
    def deep(n: int) -> None:
        if n:
            deep(n - 1)
        raise KeyError("k")

    try:
        deep(10)
    except KeyError as exc:
        text = where(exc, frames=3)
    assert text.count("deep") == 3 and "test_where_keeps" not in text
    assert "raised from" not in text
