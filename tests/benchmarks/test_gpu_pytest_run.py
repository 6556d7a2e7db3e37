"""The GPU suite's ``pytest -m cuda`` names what failed and why even when it is stopped at its time
limit (benchmarks/gpu/pytest_run.py): a run cut off on a lent GPU once left only a line of dots."""

from __future__ import annotations

import json

from benchmarks.gpu.pytest_run import run_pytest

TESTS = """
import time
import pytest

pytestmark = pytest.mark.cuda

def test_passes():
    assert True

def test_fails():
    assert 1 + 1 == 3, "arithmetic"

@pytest.mark.skip(reason="not here")
def test_skipped():
    pass

def test_hangs():
    time.sleep(120)
"""


def test_a_stopped_run_still_names_its_failures(tmp_path) -> None:
    (tmp_path / "test_some.py").write_text(TESTS)
    row = run_pytest([str(tmp_path / "test_some.py")], 10.0, tmp_path, "outcomes")
    assert row["exit code"] == "stopped at 10 s"
    assert (row["passed"], row["failed"], row["skipped"]) == (1, 1, 1)
    assert "test_fails" in row["failing"] and "arithmetic" in row["failing"]
    assert row["goal: passes"] == "MISS"
    kept = [json.loads(line) for line in (tmp_path / "outcomes.jsonl").read_text().splitlines()]
    failed = [x for x in kept if x["outcome"] == "failed"]
    assert len(failed) == 1 and "assert 1 + 1 == 3" in failed[0]["message"]


def test_a_run_that_finishes_passes_on_its_exit_code(tmp_path) -> None:
    (tmp_path / "test_ok.py").write_text("import pytest\n\n@pytest.mark.cuda\ndef test_ok():\n    pass\n")
    row = run_pytest([str(tmp_path / "test_ok.py")], 60.0, tmp_path, "outcomes")
    assert row["exit code"] == 0 and row["passed"] == 1 and row["failing"] == "-"
    assert row["goal: passes"] == "PASS"
