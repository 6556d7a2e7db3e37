"""The GPU suite in one command, in steps that each fit a lent machine's 10-minute command limit.

    python -m benchmarks.gpu --steps exactness,invariance --budget-s 540        # on the GPU machine
    python -m benchmarks.gpu --steps engine --dtypes bf16 --budget-s 540
    python -m benchmarks.gpu --cpu-smoke --out /tmp/gpu-smoke                  # every step, tiny, CPU

Steps (in the order given): exactness, engine, routing, memory, training, server, invariance
(docs/gpu.md says which to run in which order). Each writes ``<step>.json`` and ``<step>.md`` into
``--out`` (default ``$OUT`` when set, else ``./gpu-results``) after every measurement, so a command
cut off by its time limit still leaves what it finished. ``--budget-s`` is the whole command's: a
step stops starting new measurements when too little is left, says so, and ends "partial".
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

import torch

from benchmarks.common import pin_malloc

from . import engine, exactness, invariance, routing, server, training
from .plan import DTYPES, Plan
from .report import Budget, StepReport, environment

STEPS = {
    "exactness": exactness.run,
    "engine": engine.run,
    "routing": routing.run_routing,
    "memory": routing.run_memory,
    "training": training.run,
    "server": server.run,
    "invariance": invariance.run,
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
    parser.add_argument("--steps", default=",".join(STEPS), help="comma-separated, run in this order")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-results"))
    parser.add_argument("--budget-s", type=float, default=540.0, help="seconds for the whole command")
    parser.add_argument("--cpu-smoke", action="store_true", help="every grid shrunk, on CPU (CI)")
    parser.add_argument("--device", default="auto", help="auto (cuda when present), cuda or cpu")
    parser.add_argument("--archs", help="comma-separated base shapes (benchmarks/gpu/plan.py ARCHS)")
    parser.add_argument("--large", help="shapes the engine step runs after --archs ('' for none)")
    parser.add_argument("--dtypes", help="comma-separated: fp32, bf16, fp16")
    parser.add_argument("--batches", help="comma-separated batch sizes")
    parser.add_argument("--ks", help="comma-separated adapter counts for the engine step")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--tries", help="engine variants to try: sdpa,compile,cudagraph ('' for none)")
    return parser.parse_args(argv)


def plan_for(args: argparse.Namespace) -> Plan:
    if args.cpu_smoke:
        base = Plan.smoke_plan()
    else:
        name = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
        base = Plan(device=torch.device("cpu" if name == "auto" else name))
    return base.narrowed(
        archs=_names(args.archs),
        large=_names(args.large),
        dtypes=_names(args.dtypes, DTYPES),
        batches=_ints(args.batches),
        ks=_ints(args.ks),
        rounds=args.rounds,
        tries=_names(args.tries),
    )


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    steps = _names(args.steps, STEPS) or ()
    plan = plan_for(args)
    pin_malloc()  # as `memvit serve` does (CPU allocations of the host side)
    budget = Budget(args.budget_s)
    env = environment(plan.device)
    failed = False
    print(f"GPU suite on {env.get('gpu') or plan.device}, results in {args.out.resolve()}", flush=True)
    for step in steps:
        report = StepReport(args.out, step, env, plan.settings())
        print(f"-- {step}", flush=True)
        try:
            report.finish(STEPS[step](plan, report, budget))
        except Exception:  # the step's own error, recorded; the next step still runs
            report.note("step failed: " + traceback.format_exc()[-1500:])
            report.finish("error")
            failed = True
        print(
            f"   {report.status} in {report.as_json()['elapsed_s']} s -> {args.out / (step + '.md')}",
            flush=True,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
