"""A pytest plugin (``-p benchmarks.pytest_outcomes``): every test's outcome written as it is reported,
one JSON line each, to the file named by ``MEMVIT_PYTEST_OUTCOMES`` (the GPU suite's ``pytest -m
cuda``, benchmarks/gpu/pytest_run.py: a run stopped at its time limit still names its failures and
why). The standard library only, so that loading it costs a run nothing.
"""

from __future__ import annotations

import json
import os
from typing import Any

OUTCOMES = "MEMVIT_PYTEST_OUTCOMES"


def pytest_runtest_logreport(report: Any) -> None:
    """pytest's hook, once per phase of each test: the call's outcome, and a setup or teardown's
    when it failed (an error) or skipped."""
    path = os.environ.get(OUTCOMES)
    if not path or (report.when != "call" and report.passed):
        return
    outcome = report.outcome if report.when == "call" or report.skipped else "error"
    line = {"test": report.nodeid, "outcome": outcome, "when": report.when, "s": round(report.duration, 2)}
    if report.failed:
        line["message"] = report.longreprtext[-1500:]
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(line) + "\n")
