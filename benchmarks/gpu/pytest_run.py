"""``pytest -m cuda`` on the lent GPU, so that a run cut off at its time limit still names what failed
and why.

pytest prints its failures' summary at the end of a session: on 2026-11-28 a run cut at its limit
(its test time had grown past it) left only a line of dots, five of them F, and the lease was
spent. So the run loads a plugin (``-p benchmarks.pytest_outcomes``, which imports nothing but the
standard library), which writes every test's outcome as it is reported, one JSON line each (the
failure's text cut to its last 1,500 characters), to the file named by ``MEMVIT_PYTEST_OUTCOMES``;
the runner reads that file whether pytest finished or was stopped, and keeps it beside the step's
report.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import REPO
from benchmarks.pytest_outcomes import OUTCOMES

from .report import goal


def run_pytest(paths: list[str], timeout: float, out_dir: Path, name: str) -> dict[str, Any]:
    """``pytest -m cuda paths`` (paths and options) in a child process, stopped after ``timeout`` s;
    the outcomes so far kept as ``out_dir/<name>.jsonl``. Returns the report's row: counts, failing
    tests, the goal."""
    outcomes = Path(out_dir) / f"{name}.jsonl"
    outcomes.unlink(missing_ok=True)
    args = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider"]
    args += ["-p", "benchmarks.pytest_outcomes", *paths]
    env = {**os.environ, OUTCOMES: str(outcomes)}
    proc = subprocess.Popen(
        args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
        code: int | str = proc.returncode
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # pytest ends the test it is in and reports what ran
        try:
            output, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        code = f"stopped at {timeout:.0f} s"
    return _row(code, output, outcomes)


def _row(code: int | str, output: str, outcomes: Path) -> dict[str, Any]:
    lines = [json.loads(line) for line in outcomes.read_text().splitlines()] if outcomes.exists() else []
    count = {
        kind: sum(1 for x in lines if x["outcome"] == kind)
        for kind in ("passed", "failed", "error", "skipped")
    }
    bad = [x for x in lines if x["outcome"] in ("failed", "error")]
    summary = [line for line in output.splitlines() if line.strip()]
    return {
        "exit code": code,
        **count,
        "failing": "; ".join(f"{x['test']}: {_said(x.get('message', ''))}" for x in bad)[:2000] or "-",
        "summary": summary[-1][:300] if summary else "-",
        "goal: passes": goal(1 if bad or code != 0 else 0, "==", 0),
    }


def _said(message: str) -> str:
    """What a failure says in a line: its first ``E`` line (the exception and its message), else its
    last line."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("E ")]
    return (errors[:1] or lines[-1:] or [""])[0][:300]
