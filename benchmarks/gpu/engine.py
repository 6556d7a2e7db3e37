"""Step ``engine``: the fused pass against timm's own model and against the FLOP floor.

Per base shape, dtype and batch: base-only memvit vs timm img/s (goal >= 0.98); fused K adapters
(m memory tokens) vs the FLOP floor R(K) (goal <= 1.10 R); the dense-mask reference at K = 64. On
one shape (``Plan.tries_on``) the tries (``Plan.tries``), each against the eager pass: SDPA backends
for the base path (and whether memvit stays bitwise timm's under each), ``torch.compile`` of the
adapter attention and of the whole pass, a CUDA graph of the features.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

import memvit.memory_core.attention as attention
from memvit.memory_core import MemoryViT, flop_ratio, uniform_adapters
from memvit.memory_core.reference import DenseMemoryViT

from .plan import Plan, adapters, engine, images, rate, ratio, sync, timed_rounds
from .report import Budget, StepReport, goal


def run(plan: Plan, report: StepReport, budget: Budget) -> str:
    for arch in (*plan.archs, *plan.large):
        pool = {m: adapters(engine(arch, plan), max(plan.ks), m, plan.classes) for m in plan.ms}
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
    settings = [
        (f"K={k} m={m}", "fused vs R(K)", {"K": k, "m": m}, _fused, w[:k])
        for m, w in pool.items()
        for k in plan.ks
    ]
    settings.append(
        (
            f"dense K={plan.dense_k}",
            "dense reference",
            {"K": plan.dense_k},
            _dense,
            pool[plan.ms[0]][: plan.dense_k],
        )
    )
    with torch.inference_mode():
        report.attempt("base only vs timm", what, _base_vs_timm, e, x, plan)
        for label, table, extra, measure, weights in settings:
            if not report.room(budget):
                report.note(f"budget spent: stopped before {what} {label}")
                return False
            report.attempt(table, {**what, **extra}, measure, e, x, weights, plan)
        # The tries once (one shape, first dtype, largest batch): a compile takes a minute.
        if arch == plan.tries_on and what["dtype"] == plan.dtypes[0] and what["batch"] == plan.batches[-1]:
            for name in plan.tries:
                if budget.allows(120):
                    _try(name, e, x, pool[plan.ms[0]], plan, report, what)
    return True


def _base_vs_timm(e: MemoryViT, x: torch.Tensor, plan: Plan) -> dict:
    times = timed_rounds({"timm": lambda: e.base(x), "memvit": lambda: e(x)}, plan.device, plan.rounds)
    share = ratio(times, "timm", "memvit")  # memvit img/s over timm's
    same = torch.equal(e(x).base, e.base(x))
    return {
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
    return {
        "fused_img_s": rate(times["fused"], len(x)),
        "dense_img_s": rate(times["dense"], len(x)),
        "dense/fused time": ratio(times, "dense", "fused"),
        "goal: fused faster": goal(ratio(times, "dense", "fused"), ">=", 1.0),
    }


def _try(
    name: str, e: MemoryViT, x: torch.Tensor, pool: list, plan: Plan, report: StepReport, what: dict
) -> None:
    s = e.prepare_set(pool[:64])
    if name == "sdpa":
        for backend in _sdpa_backends(plan.device):
            report.attempt(
                "try: SDPA backend, base path",
                {**what, "backend": backend.name},
                _sdpa,
                e,
                x,
                backend,
                plan,
            )
    elif name == "compile":
        report.attempt(
            "try: torch.compile",
            {**what, "K": len(s), "what": "adapter attention"},
            _compiled_adapter_path,
            e,
            x,
            s,
            plan,
        )
        report.attempt(
            "try: torch.compile",
            {**what, "K": len(s), "what": "whole pass"},
            _compiled_pass,
            e,
            x,
            s,
            plan,
        )
    elif name == "cudagraph":
        if plan.device.type != "cuda":
            report.add("try: CUDA graph", {**what, "skipped": "needs CUDA"})
        else:
            report.attempt("try: CUDA graph", {**what, "K": len(s)}, _graphed, e, x, s, plan)


def _sdpa_backends(device: torch.device) -> list:
    from torch.nn.attention import SDPBackend

    if device.type != "cuda":
        return [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    return [
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.MATH,
    ]


def _sdpa(e: MemoryViT, x: torch.Tensor, backend, plan: Plan) -> dict:
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([backend]):
        times = timed_rounds({"timm": lambda: e.base(x), "memvit": lambda: e(x)}, plan.device, plan.rounds)
        same = torch.equal(e(x).base, e.base(x))
    return {
        "memvit_img_s": rate(times["memvit"], len(x)),
        "memvit/timm": ratio(times, "timm", "memvit"),
        "bitwise vs timm": same,
    }


def _against_eager(
    e: MemoryViT, x: torch.Tensor, s, plan: Plan, fast: Callable[[], object], label: str
) -> dict:
    started = time.perf_counter()
    fast()
    sync(plan.device)
    first_s = time.perf_counter() - started
    times = timed_rounds({"eager": lambda: e(x, s), label: fast}, plan.device, plan.rounds)
    return {
        "first call s": first_s,
        f"{label}_img_s": rate(times[label], len(x)),
        f"eager/{label} time": ratio(times, "eager", label),
    }


def _compiled_adapter_path(e: MemoryViT, x: torch.Tensor, s, plan: Plan) -> dict:
    eager = attention.adapter_attention
    attention.adapter_attention = torch.compile(eager, dynamic=False)  # merged_block looks it up per call
    try:
        row = _against_eager(e, x, s, plan, lambda: e(x, s), "compiled")
    finally:
        attention.adapter_attention = eager
    return row


def _compiled_pass(e: MemoryViT, x: torch.Tensor, s, plan: Plan) -> dict:
    compiled = torch.compile(lambda images: e.forward_features(images, s.stack), dynamic=False)
    row = _against_eager(e, x, s, plan, lambda: e.forward_head(*compiled(x), s), "compiled")
    diff = (e.forward_head(*compiled(x), s).base.float() - e(x, s).base.float()).abs().max().item()
    return {**row, "max diff vs eager": diff}


def _graphed(e: MemoryViT, x: torch.Tensor, s, plan: Plan) -> dict:
    # The features only: the grouped heads read their member lists on the host, which a graph cannot.
    static = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            e.forward_features(static, s.stack)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tokens = e.forward_features(static, s.stack)

    def replay() -> object:
        graph.replay()
        return e.forward_head(*tokens, s)

    return _against_eager(e, x, s, plan, replay, "graphed")
