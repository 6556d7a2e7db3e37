"""Step ``exactness``: memvit's numbers on the device, per dtype.

Base logits against timm's on the same device and dtype (bitwise where the kernels are the same: the
base-only pass runs timm's own modules; with adapters the base rows share each product with the
class-token rows, so only a bound holds); adapter logits against the dense-mask reference run in
float32 on the same device (the max difference per dtype, against the bounds of docs/design.md §2.6);
routed against unrouted; the real DeiT-Tiny when the shared data is there; and ``pytest -m cuda``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.common import DEIT_TINY
from memvit.memory_core import LiveAdapters, MemoryViT
from memvit.memory_core.oracle.reference import DenseMemoryViT
from tests.factories import random_adapter

from .plan import DTYPES, Plan, engine, images
from .pytest_run import run_pytest
from .report import Budget, StepReport, goal

# Max |difference| of logits (magnitude ~1-10) against the float32 dense reference.
BOUNDS = {"fp32": 1e-4, "bf16": 0.06, "fp16": 0.01}


def run(plan: Plan, report: StepReport, budget: Budget) -> str:
    for arch in plan.archs:
        for dtype in plan.dtypes:
            if not report.room(budget, 30):
                report.note(f"budget spent: stopped before {arch} {dtype}")
                return "partial"
            report.attempt(
                "synthetic bases",
                {"arch": arch, "dtype": dtype},
                _compare,
                arch,
                dtype,
                plan,
            )
    if plan.smoke:
        report.note("real DeiT-Tiny: not run in --cpu-smoke")
    elif DEIT_TINY.is_file():
        for dtype in plan.dtypes:
            report.attempt("real DeiT-Tiny", {"dtype": dtype}, _real, dtype, plan)
    else:
        report.note(f"real DeiT-Tiny not found at {DEIT_TINY}: set MEMVIT_SHARED_DATA (docs/gpu.md)")
    if plan.device.type != "cuda":
        report.note("pytest -m cuda: not run (no CUDA device)")
    elif budget.allows(plan.pytest_s + 30):
        timeout = min(plan.pytest_s, budget.left() - 30)
        report.attempt("pytest -m cuda", {}, _pytest_cuda, timeout, report.out)
    else:
        report.note(
            "pytest -m cuda: not run (budget spent); run it alone: python3 -m pytest -m cuda "
            + " ".join(ENGINE_TESTS)
        )
    return "done"


def _mixed(e: MemoryViT) -> list:
    return [
        random_adapter("m0", e, m=0, memory_std=0.02),
        random_adapter("m1", e, m=1, memory_norm="none", memory_std=0.02),
        random_adapter("m5", e, m=5, classes=11, memory_std=0.02),
        random_adapter("child", e, m=2, parent="m5", memory_std=0.02),
    ]


def _compare(arch: str, dtype: str, plan: Plan) -> dict:
    reference = engine(arch, plan)  # float32
    weights = _mixed(reference)
    x32 = images(reference, 4)
    with torch.inference_mode():
        _, dense = DenseMemoryViT(reference.base, weights)(x32)
        e = reference if dtype == "fp32" else engine(arch, plan, dtype)
        x = x32.to(DTYPES[dtype])
        live = LiveAdapters(e)
        live.replace_all(weights)
        base_only, timm = e(x).base, e.base(x)
        fused = e(x, live.current)
        routed = e(x, live.current, tasks=[["m1", "child"]] * len(x))
    adapter_diff = max(_diff(fused.adapters[w.name], dense[w.name]) for w in weights)
    return {
        "base only == timm": torch.equal(base_only, timm),
        "base only vs timm": _diff(base_only, timm),
        "base with 4 adapters vs timm": _diff(fused.base, timm),
        "adapters vs dense fp32": adapter_diff,
        "bound": BOUNDS[dtype],
        "goal: within": goal(adapter_diff, "<=", BOUNDS[dtype]),
        "routed vs unrouted": max(_diff(routed.adapters[n], fused.adapters[n]) for n in ("m1", "child")),
    }


def _real(dtype: str, plan: Plan) -> dict:
    e = MemoryViT.from_timm(weights=str(DEIT_TINY), device=plan.device, dtype=DTYPES[dtype])
    reference = MemoryViT.from_timm(weights=str(DEIT_TINY), device=plan.device)
    x = images(reference, 16)
    with torch.inference_mode():
        base_only, timm = e(x.to(e.dtype)).base, e.base(x.to(e.dtype))
        full = reference(x).base
    agree = (base_only.argmax(-1) == full.argmax(-1)).float().mean().item()
    return {
        "base only == timm": torch.equal(base_only, timm),
        "base only vs timm": _diff(base_only, timm),
        "vs fp32 logits": _diff(base_only, full),
        "top-1 agreement with fp32": agree,
    }


# The engine's and the server's CUDA tests (22 of 37). The trainer's (14, two of them whole training
# runs; with them the whole set passed 100 s on the H200 at bc5197c before its 24th test) are the
# training step's (training.py ``PYTEST``), run under ``--steps training`` or alone (docs/gpu.md).
ENGINE_TESTS = (
    "tests",
    "--ignore=tests/adapters/training",
    "--ignore=tests/server/cli/test_train_torchrun.py",
)


def _pytest_cuda(timeout: float, out_dir: Path) -> dict:
    return run_pytest(list(ENGINE_TESTS), timeout, out_dir, "pytest-cuda")


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()
