"""The GPU suite: every step in one command of a lent GPU (``--all``), or chosen steps.

    python -m benchmarks.gpu --all                                   # on the GPU machine, < 9 minutes
    python -m benchmarks.gpu --steps engine --dtypes bf16 --budget-s 540
    python -m benchmarks.gpu --all --cpu-smoke --out /tmp/gpu-smoke   # every step, tiny, CPU (CI)

Steps: exactness, engine, routing, memory, training, server, invariance, profile (docs/gpu.md).
``--all`` runs them all, each on its own grid (schedule.py), into one ``suite.json`` and one
``suite.md``; ``--steps`` runs the ones named, in that order, each into ``<step>.json`` and
``<step>.md``. Reports go to ``--out`` (default ``$OUT`` when set, else ``./gpu-results``) after
every measurement, so a command cut off by its time limit still leaves what it finished.
``--budget-s`` is the whole command's: a step stops starting new measurements when too little is
left, says so, and ends "partial"; under ``--all`` each step also leaves the later steps their
reserve.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

import torch

from benchmarks.common import pin_malloc

from . import engine, exactness, invariance, profiling, routing, server, training
from .plan import DTYPES, Plan
from .report import Budget, StepReport, SuiteFile, environment
from .schedule import ALL, BUDGET_S, Part

STEPS = {
    "exactness": exactness.run,
    "engine": engine.run,
    "routing": routing.run_routing,
    "memory": routing.run_memory,
    "training": training.run,
    "server": server.run,
    "invariance": invariance.run,
    "profile": profiling.run,
}


def _ints(text: str | None) -> tuple[int, ...] | None:
    return None if text is None else tuple(int(v) for v in text.split(","))


def _names(text: str | None, known: dict | None = None) -> tuple[str, ...] | None:
    if text is None:
        return None
    names = tuple(v for v in text.split(",") if v)
    if known is not None and (unknown := [n for n in names if n not in known]):
        raise SystemExit(f"unknown: {unknown}; known: {sorted(known)}")
    return names


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n")[0])
    parser.add_argument("--all", action="store_true", help="every step on its own grid, one report")
    parser.add_argument("--steps", default=",".join(STEPS), help="comma-separated, run in this order")
    parser.add_argument("--skip", help="with --all: comma-separated steps to leave out")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-results"))
    parser.add_argument(
        "--budget-s", type=float, help=f"seconds for the whole command ({BUDGET_S:.0f} with --all, else 540)"
    )
    parser.add_argument("--cpu-smoke", action="store_true", help="every grid shrunk, on CPU (CI)")
    parser.add_argument("--device", default="auto", help="auto (cuda when present), cuda or cpu")
    parser.add_argument("--archs", help="comma-separated base shapes (benchmarks/gpu/plan.py ARCHS)")
    parser.add_argument("--large", help="shapes the engine step runs after --archs ('' for none)")
    parser.add_argument("--dtypes", help="comma-separated: fp32, bf16, fp16")
    parser.add_argument("--batches", help="comma-separated batch sizes")
    parser.add_argument("--ks", help="comma-separated adapter counts for the engine step")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--tries", help="sdpa,graphs,kernels,ahead,tiles,gemms ('' for none)")
    parser.add_argument("--server-seconds", type=float, help="seconds of each server load (20 with --steps)")
    return parser.parse_args(argv)


def base_plan(args: argparse.Namespace) -> Plan:
    if args.cpu_smoke:
        return Plan.smoke_plan()
    name = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    return Plan(device=torch.device("cpu" if name == "auto" else name))


def overrides(args: argparse.Namespace) -> dict:
    """The command line's narrowing of the plan (None: keep)."""
    return {
        "archs": _names(args.archs),
        "large": _names(args.large),
        "dtypes": _names(args.dtypes, DTYPES),
        "batches": _ints(args.batches),
        "ks": _ints(args.ks),
        "rounds": args.rounds,
        "tries": _names(args.tries),
        "server_seconds": args.server_seconds,
    }


def parts_for(args: argparse.Namespace) -> tuple[Part, ...]:
    if args.all:
        skipped = set(_names(args.skip, STEPS) or ())
        return tuple(part for part in ALL if part.step not in skipped)
    return tuple(Part(step) for step in _names(args.steps, STEPS) or ())


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    parts = parts_for(args)
    base = base_plan(args)
    pin_malloc()  # as `memvit serve` does (CPU allocations of the host side)
    budget = Budget(args.budget_s if args.budget_s is not None else BUDGET_S if args.all else 540.0)
    env = environment(base.device)
    suite = SuiteFile(args.out, "suite", env, {p.step: p.estimate_s for p in parts}) if args.all else None
    failed = False
    print(f"GPU suite on {env.get('gpu') or base.device}, results in {args.out.resolve()}", flush=True)
    for index, part in enumerate(parts):
        # The smoke plan's tiny grid stands in for every step's GPU grid.
        plan = (base if base.smoke else base.narrowed(**part.overrides)).narrowed(**overrides(args))
        report = StepReport(args.out, part.step, env, plan.settings(), suite)
        step_budget = budget.keeping(sum(p.reserve_s for p in parts[index + 1 :]))
        print(f"-- {part.step} ({step_budget.left():.0f} s of {budget.left():.0f} s left)", flush=True)
        try:
            report.finish(STEPS[part.step](plan, report, step_budget))
        except Exception:  # the step's own error, recorded; the next step still runs
            report.note("step failed: " + traceback.format_exc()[-1500:])
            report.finish("error")
            failed = True
        where = args.out / ("suite.md" if suite else part.step + ".md")
        print(f"   {report.status} in {report.as_json()['elapsed_s']} s -> {where}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
