"""Step ``training``: the trainer on the device, as ``memvit train --device cuda`` runs it.

- ``training step``: per shape, precision and batch, the trainer's own step (``TrainStep``,
  adapters/training/step.py: the adapters' preparation, the pass forward, base included, the way
  back to the parameters and the joint optimiser step as one CUDA graph; whether the graph was used
  is in the row) for 1 and for 8 variants of a sweep, against one fused inference pass on the same
  batch as it is served (a graph replay, in the step's precision: a float32 or a bfloat16 engine),
  and per step what runs outside the graph (step_ops.py: aten ops, graph launches, host syncs; on
  the CPU the graph's route rehearsed). Goals: step <= 1.5 x an inference pass; 8 variants <= 1.3 x
  one.
- ``training step, profiled`` (``--steps training``): what each call launches and waits for, per call
  and precision (benchmarks/gpu/trace.py): kernels, launch calls, graph launches, host syncs, aten
  ops, GPU busy time.
- ``same numbers`` (``--steps training``): the end-to-end regime of benchmarks/train_regime.py in
  float32 and bfloat16 against the CPU's recorded run (training_regime.py).
- ``pytest -m cuda`` of the trainer (``--steps training``): tests/adapters/training and the torchrun test.

A failed row keeps, beside its error, where it was raised (``where``: traced.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from memvit.adapters.training import TrainConfig
from memvit.adapters.training.step import TrainStep
from memvit.adapters.training.step_graph import WARM_UP
from memvit.adapters.training.variant import Variant

from . import training_regime
from .plan import Plan, engine, images, rate, ratio, timed_rounds
from .profiling import profiled_pass
from .pytest_run import run_pytest
from .report import Budget, StepReport, goal
from .step_ops import step_ops
from .traced import traced

CLASSES = 10
PRECISION = {"fp32": "float32", "bf16": "bfloat16"}
PYTEST = ("tests/adapters/training", "tests/server/cli/test_train_torchrun.py")


def run(plan: Plan, report: StepReport, budget: Budget) -> str:
    for arch in plan.archs:
        for precision in plan.train_precisions:
            for batch in plan.train_batches:
                if not report.room(budget, 30):
                    report.note(f"budget spent: stopped before {arch} {precision} batch {batch}")
                    return "partial"
                what = {"arch": arch, "precision": precision, "batch": batch}
                report.attempt("training step", what, traced(_step), arch, precision, batch, plan)
    if not plan.train_extras:
        return "done"
    for arch in plan.archs:
        if not report.room(budget, 30):
            report.note(f"budget spent: stopped before profiling {arch}")
            return "partial"
        for precision in plan.train_precisions:
            what = {"arch": arch, "precision": precision, "batch": plan.train_batches[0]}
            found = traced(_profiled_calls)(arch, precision, plan)
            if "error" in found:
                report.add("training step, profiled", {**what, **found})
                continue
            for call, row in found.items():
                report.add("training step, profiled", {**what, "call": call, **row})
    if training_regime.run(plan, report, budget) != "done":
        return "partial"
    if plan.device.type != "cuda":
        report.note("pytest -m cuda (trainer): not run (no CUDA device)")
    elif budget.allows(90):
        timeout = min(plan.pytest_s, budget.left() - 30)
        report.attempt("pytest -m cuda (trainer)", {}, traced(_pytest_cuda), timeout, report.out)
    else:
        report.note(
            "pytest -m cuda (trainer): not run (budget spent); run it alone: python3 -m pytest -m cuda "
            + " ".join(PYTEST)
        )
    return "done"


def _variants(e, x: torch.Tensor, n: int) -> list[Variant]:
    classes = tuple(f"c{i}" for i in range(CLASSES))
    made = []
    for i in range(n):  # a sweep's variants: learning rates and memory sizes differ, the data is shared
        config = TrainConfig(
            name=f"v{i}", train_dir="-", lr=0.01 * (i + 1), memory_tokens=(1, 5)[i % 2], steps=1000
        )
        v = Variant(e, config, classes, None, total=1000, init_images=x[:4])  # on the engine's device
        with torch.no_grad():
            v.adapter.head.weight.normal_(0, 0.02)  # every parameter gets a gradient from the first step
        made.append(v)
    return made


def _calls(arch: str, precision: str, batch: int, plan: Plan) -> tuple[dict, tuple[TrainStep, TrainStep]]:
    """The inference pass as served and the trainer's step for 1 and ``plan.variants`` variants."""
    e = engine(arch, plan)  # float32 weights: the trainer's bfloat16 is autocast over them
    served_engine = e if precision == "fp32" else engine(arch, plan, precision)
    x = images(e, batch)
    y = torch.randint(0, CLASSES, (batch,), generator=torch.Generator().manual_seed(0)).to(e.device)
    e.train()  # as the run does: the base stays in eval mode (MemoryViT.train)
    one, many = _variants(e, x, 1), _variants(e, x, plan.variants)
    rehearse = e.device.type == "cpu"  # the graph's route without a graph: counts as on a GPU
    step_one = TrainStep(e, one, None, PRECISION[precision], rehearse=rehearse)
    step_many = TrainStep(e, many, None, PRECISION[precision], rehearse=rehearse)
    for step in (step_one, step_many):  # past the graphs' warm-up and capture (step_graph.WARM_UP)
        for _ in range(WARM_UP + 2):
            step(x, y)
        step.pending.clear()
    served = served_engine.prepare_set([one[0].adapter.weights()])
    x_served = x.to(served_engine.dtype)

    def infer() -> None:
        with torch.inference_mode():
            served_engine(x_served, served)

    def stepped(step: TrainStep):
        def call() -> None:
            step(x, y)
            step.pending.clear()  # what flush would read back: not this benchmark's to time

        return call

    calls = {"infer": infer, "step 1": stepped(step_one), f"step {plan.variants}": stepped(step_many)}
    return calls, (step_one, step_many)


def _step(arch: str, precision: str, batch: int, plan: Plan) -> dict:
    calls, (step_one, _) = _calls(arch, precision, batch, plan)
    times = timed_rounds(calls, plan.device, plan.rounds)
    n = plan.variants
    one, many = (_ops(calls[name], plan) for name in ("step 1", f"step {n}"))
    per_infer = ratio(times, "step 1", "infer")
    many_over_one = ratio(times, f"step {n}", "step 1")
    return {
        "infer_img_s": rate(times["infer"], batch),
        "step 1: img/s": rate(times["step 1"], batch),
        f"step {n}: img/s": rate(times[f"step {n}"], batch),
        "step 1 / infer": per_infer,
        "goal <= 1.5": goal(per_infer, "<=", 1.5),
        f"step {n} / step 1": many_over_one,
        "goal <= 1.3": goal(many_over_one, "<=", 1.3),
        "step graphed": _graphed(step_one.path.graphed, step_one.path.failed, step_one.path.static),
        # What the host still launches one by one around the graph, per step (step_ops.py):
        "ops outside the graph, step 1": one["outside the graph"],
        f"ops outside the graph, step {n}": many["outside the graph"],
        "graph launches / step": one["graph launches"],  # 1 when graphed (None on the CPU)
        "host syncs / step": one["host syncs"],
    }


def _ops(call, plan: Plan) -> dict:
    """``step_ops`` of a step, or why not: the row keeps its timings if profiling fails."""
    try:
        return step_ops(call, 3, cuda=plan.device.type == "cuda")
    except Exception as exc:  # a profiler failure on the lent machine must not lose the timings
        failed = f"error: {type(exc).__name__}: {exc}"[:200]
        return {"outside the graph": failed, "graph launches": None, "host syncs": None}


def _graphed(graphed: bool, failed: str | None, rehearsed: bool = False) -> str:
    """Whether the step ran as a CUDA graph, and if not why not."""
    if graphed:
        return "yes"
    if failed:
        return f"no: {failed}"[:200]
    return "no: the graph's route rehearsed (CPU)" if rehearsed else "no"


def _profiled_calls(arch: str, precision: str, plan: Plan) -> dict[str, dict]:
    """Each call at the first batch in ``precision``, profiled (profiling.py's counts per call)."""
    calls, _ = _calls(arch, precision, plan.train_batches[0], plan)
    keep = ("wall ms", "launch calls", "graph launches", "host syncs", "kernels", "aten ops", "GPU busy ms")
    return {
        name: {k: v for k, v in profiled_pass(fn, plan, None).items() if k in keep}
        for name, fn in calls.items()
    }


def _pytest_cuda(timeout: float, out_dir: Path) -> dict:
    return run_pytest(list(PYTEST), timeout, out_dir, "pytest-cuda-trainer")
