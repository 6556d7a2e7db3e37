"""Step ``engine``: the fused pass against timm's own model and against the FLOP floor.

Per base shape, dtype and batch: base-only memvit (CUDA graphs on, as it serves) vs timm img/s and
whether its logits are timm's bit for bit (goal >= 0.98); fused K adapters (m memory tokens) vs the
FLOP floor R(K) (goal <= 1.10 R); the dense-mask reference against the fused pass at K = 64 (goal:
the fused pass at least 2x faster). On the shapes of ``Plan.tries_on``, at the smallest batch, the
tries of tries.py: SDPA backends, what CUDA graphs gain, Triton against torch kernels.
"""

from __future__ import annotations

import torch

from memvit.memory_core import MemoryViT, flop_ratio, uniform_adapters
from memvit.memory_core.oracle.reference import DenseMemoryViT

from . import tries
from .plan import Plan, adapters, engine, images, rate, ratio, timed_rounds
from .report import Budget, StepReport, goal


def run(plan: Plan, report: StepReport, budget: Budget) -> str:
    for arch in (*plan.archs, *plan.large):
        tried = arch in plan.tries_on and plan.tries
        count = max(*plan.ks, plan.dense_k, plan.loaded if tried else 0)
        pool = {m: adapters(engine(arch, plan), count, m, plan.classes) for m in plan.ms}
        for dtype in plan.dtypes:
            for batch in plan.batches:
                what = {"arch": arch, "dtype": dtype, "batch": batch}
                if not _grid(plan, report, budget, arch, what, pool):
                    return "partial"
                if plan.device.type == "cuda":
                    torch.cuda.empty_cache()
    return "done"


def _grid(plan: Plan, report: StepReport, budget: Budget, arch: str, what: dict, pool: dict) -> bool:
    """One shape, dtype and batch: every measurement of the step. False: the budget ran out."""
    if not report.room(budget, 60):
        report.note(f"budget spent: stopped before {what}")
        return False
    e = engine(arch, plan, what["dtype"])
    x = images(e, what["batch"])
    first = pool[plan.ms[0]]
    settings = [
        (f"K={k} m={m}", "fused vs R(K)", {"K": k, "m": m}, _fused, w[:k])
        for m, w in pool.items()
        for k in plan.ks
    ]
    settings.append(
        (f"dense K={plan.dense_k}", "dense reference", {"K": plan.dense_k}, _dense, first[: plan.dense_k])
    )
    with torch.inference_mode():
        report.attempt("base only vs timm", what, _base_vs_timm, e, x, plan)
        for label, table, extra, measure, weights in settings:
            if not report.room(budget):
                report.note(f"budget spent: stopped before {what} {label}")
                return False
            report.attempt(table, {**what, **extra}, measure, e, x, weights, plan)
        # The tries at the smallest batch, where a pass is most bound by the host.
        if arch in plan.tries_on and what["dtype"] == plan.dtypes[0] and what["batch"] == plan.batches[0]:
            tries.run(e, x, first, plan, report, budget, what)
    return True


def _base_vs_timm(e: MemoryViT, x: torch.Tensor, plan: Plan) -> dict:
    times = timed_rounds({"timm": lambda: e.base(x), "memvit": lambda: e(x)}, plan.device, plan.rounds)
    share = ratio(times, "timm", "memvit")  # memvit img/s over timm's
    same = torch.equal(e(x).base, e.base(x))
    return {
        "graphed": e.graphed,
        "timm_img_s": rate(times["timm"], len(x)),
        "memvit_img_s": rate(times["memvit"], len(x)),
        "memvit/timm": share,
        "goal >= 0.98": goal(share, ">=", 0.98),
        "bitwise": same,
    }


def _fused(e: MemoryViT, x: torch.Tensor, weights: list, plan: Plan) -> dict:
    s = e.prepare_set(weights)
    times = timed_rounds({"base": lambda: e(x), "fused": lambda: e(x, s)}, plan.device, plan.rounds)
    floor = flop_ratio(e.spec, uniform_adapters(len(weights), weights[0].num_memory, plan.classes))
    over = ratio(times, "fused", "base") / floor
    return {
        "fused_img_s": rate(times["fused"], len(x)),
        "fused/base": ratio(times, "fused", "base"),
        "R(K)": floor,
        "(fused/base)/R": over,
        "goal <= 1.10": goal(over, "<=", 1.10),
    }


def _dense(e: MemoryViT, x: torch.Tensor, weights: list, plan: Plan) -> dict:
    s = e.prepare_set(weights)
    dense = DenseMemoryViT(e.base, weights)
    times = timed_rounds({"fused": lambda: e(x, s), "dense": lambda: dense(x)}, plan.device, plan.rounds)
    faster = ratio(times, "dense", "fused")
    return {
        "fused_img_s": rate(times["fused"], len(x)),
        "dense_img_s": rate(times["dense"], len(x)),
        "dense/fused time": faster,
        "goal >= 2": goal(faster, ">=", 2.0),
    }
