"""What every step of the GPU suite shares: its report (JSON + Markdown, rewritten after every row, so
a command cut off by its time limit still leaves what it finished), the run's environment, goals
and the step's time budget."""

from __future__ import annotations

import json
import math
import operator
import os
import platform
import subprocess
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import timm
import torch

from benchmarks.common import REPO, cpu_model

_OPS = {">=": operator.ge, "<=": operator.le, "==": operator.eq}


def goal(value: float | None, op: str, target: float) -> str:
    """'PASS'/'MISS' for ``value op target`` (e.g. ratio >= 0.98); '-' without a value."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return "PASS" if _OPS[op](value, target) else "MISS"


def environment(device: torch.device) -> dict[str, Any]:
    """The device, library versions and commit, recorded with every step."""
    env: dict[str, Any] = {
        "device": str(device),
        "torch": torch.__version__,
        "timm": timm.__version__,
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }
    try:
        import torchvision

        env["torchvision"] = torchvision.__version__
    except ImportError:
        env["torchvision"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
            tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
        )
    manifest = REPO / ".whl" / "manifest.json"  # prepare's record of the commit it was built from
    commit = json.loads(manifest.read_text()).get("commit") if manifest.is_file() else None
    if not commit:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            commit = ""
    env["commit"] = commit or None
    return env


class Budget:
    """The seconds a command may still use; a step checks it before each measurement."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def allows(self, seconds: float) -> bool:
        return self.left() > seconds

    def keeping(self, seconds: float) -> Budget:
        """A budget that ends ``seconds`` before this one: what a step may spend while the steps
        after it keep their share."""
        part = Budget(0.0)
        part.deadline = self.deadline - seconds
        return part


class StepReport:
    """One step's results: tables of rows, notes, status; ``<step>.json`` and ``<step>.md`` in ``out``,
    or its part of a ``SuiteFile``."""

    def __init__(
        self,
        out: Path,
        step: str,
        env: dict[str, Any],
        settings: dict[str, Any],
        suite: SuiteFile | None = None,
    ) -> None:
        self.out, self.step, self.env, self.settings = out, step, env, settings
        self.tables: dict[str, list[dict[str, Any]]] = {}
        self.notes: list[str] = []
        self.status = "running"
        self.started = time.time()
        self.ended: float | None = None  # set when the step finishes: a suite rewrites it later
        self.last_s = 0.0  # the last measurement's seconds: what the next one is expected to take
        self.suite = suite
        if suite is not None:
            suite.steps.append(self)
        out.mkdir(parents=True, exist_ok=True)
        self.flush()

    def add(self, table: str, row: dict[str, Any]) -> None:
        self.tables.setdefault(table, []).append(row)
        self.flush()

    def note(self, text: str) -> None:
        self.notes.append(text)
        self.flush()

    def attempt(
        self, table: str, what: dict[str, Any], fn: Callable[..., dict[str, Any]], *args: Any
    ) -> bool:
        """Add ``what`` plus ``fn(*args)``'s figures as a row; an error becomes the row's ``error``, not
        a crash (a step on a lent machine must not lose its other rows to one failing setting)."""
        started = time.monotonic()
        try:
            row = {**what, **fn(*args)}
        except Exception as exc:  # any failure: record it and go on with the next setting
            detail = traceback.format_exception_only(type(exc), exc)[-1].strip()
            row = {**what, "error": detail[:500]}
            if isinstance(exc, torch.cuda.OutOfMemoryError):
                torch.cuda.empty_cache()
        self.last_s = time.monotonic() - started
        self.add(table, {**row, "s": round(self.last_s, 1)})
        return "error" not in row

    def room(self, budget: Budget, floor: float = 30.0) -> bool:
        """Whether ``budget`` leaves room for another measurement like the last one (or ``floor`` s)."""
        return budget.allows(max(floor, 1.5 * self.last_s))

    def finish(self, status: str = "done") -> None:
        self.status = status
        self.ended = time.time()
        self.flush()

    def as_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "status": self.status,
            "elapsed_s": round((self.ended or time.time()) - self.started, 1),
            "env": self.env,
            "settings": self.settings,
            "tables": self.tables,
            "notes": self.notes,
        }

    def flush(self) -> None:
        if self.suite is not None:
            self.suite.flush()
            return
        data = self.as_json()
        _write(self.out / f"{self.step}.json", json.dumps(data, indent=1, default=str) + "\n")
        _write(self.out / f"{self.step}.md", markdown(data))


class SuiteFile:
    """Several steps' reports in one ``<name>.json`` and one ``<name>.md`` (a lent machine returns at
    most 8 files), rewritten after every row like a step's own."""

    def __init__(self, out: Path, name: str, env: dict[str, Any], estimates: dict[str, float]) -> None:
        self.out, self.name, self.env, self.estimates = out, name, env, estimates
        self.steps: list[StepReport] = []
        self.started = time.time()

    def as_json(self) -> dict[str, Any]:
        return {
            "suite": self.name,
            "elapsed_s": round(time.time() - self.started, 1),
            "env": self.env,
            "estimates_s": self.estimates,
            "steps": [report.as_json() for report in self.steps],
        }

    def flush(self) -> None:
        data = self.as_json()
        self.out.mkdir(parents=True, exist_ok=True)
        _write(self.out / f"{self.name}.json", json.dumps(data, indent=1, default=str) + "\n")
        _write(self.out / f"{self.name}.md", suite_markdown(data))


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)  # a reader (or a cut-off command) never sees half a file


def _environment_line(env: dict[str, Any]) -> str:
    device = env.get("gpu") or f"{env['cpu']} ({env['torch_threads']} threads)"
    return (
        f"{device}; torch {env['torch']}, timm {env['timm']}, torchvision {env.get('torchvision')}"
        + (f", CUDA {env['cuda']}, cuDNN {env['cudnn']}" if env.get("cuda") else "")
        + f"; commit {env.get('commit')}"
    )


def _step_body(data: dict[str, Any], level: str) -> list[str]:
    """A step's settings, tables and notes, its headings at ``level`` ('##' alone, '###' in a suite)."""
    lines = ["Settings: " + ", ".join(f"{k}={v}" for k, v in data["settings"].items())]
    for name, rows in data["tables"].items():
        columns = list(dict.fromkeys(k for row in rows for k in row))
        lines += ["", f"{level} {name}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    if data["notes"]:
        lines += ["", f"{level} Notes", "", *(f"- {n}" for n in data["notes"])]
    return lines


def markdown(data: dict[str, Any]) -> str:
    lines = [f"# GPU suite: {data['step']} ({data['status']}, {data['elapsed_s']} s)", ""]
    lines += [_environment_line(data["env"]), "", *_step_body(data, "##")]
    return "\n".join(lines) + "\n"


def suite_markdown(data: dict[str, Any]) -> str:
    steps = data["steps"]
    title = f"# GPU suite: every step ({data['elapsed_s']} s)"
    lines = [title, "", _environment_line(data["env"]), ""]
    lines += ["| step | status | s | planned s |", "|---|---|--:|--:|"]
    for step in steps:
        planned = data["estimates_s"].get(step["step"], "")
        lines.append(f"| {step['step']} | {step['status']} | {step['elapsed_s']} | {planned} |")
    for step in steps:
        lines += ["", f"## {step['step']} ({step['status']}, {step['elapsed_s']} s)", ""]
        lines += _step_body(step, "###")
    return "\n".join(lines) + "\n"


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value).replace("|", "/").replace("\n", " ")
