"""Steps ``routing`` and ``memory``: what many loaded adapters cost.

Loaded here means resident as a server holds them: prepared and installed (``LiveAdapters``), so each
has its device slot (memory_core/routing/slots.py) before the first pass. ``routing``: with 1,000 loaded, each
image asking for 1 random task (goal <= 1.10 R(1)) or 8 (against R(8)), against the base alone.
``memory``: peak memory of the base pass, a routed one (1 task per image) and the unrouted one with
1,000 and 10,000 loaded, eager (what a pass itself needs), what the loaded set holds (prepared
adapters and slot pools) and, on CUDA, what the three passes' captured graphs keep.
"""

from __future__ import annotations

import random
import time

import torch

from memvit.memory_core import LiveAdapters, TaskIndex, flop_ratio, uniform_adapters

from .plan import Plan, adapters, bank_adapters, engine, images, peak_mib, rate, ratio, sync, timed_rounds
from .report import Budget, StepReport, goal


def run_routing(plan: Plan, report: StepReport, budget: Budget) -> str:
    for arch in plan.archs:
        weights = adapters(engine(arch, plan), plan.loaded, 1, plan.classes)
        for dtype in plan.dtypes:
            for batch in plan.batches:
                if not report.room(budget, 20):
                    report.note(f"budget spent: stopped before {arch} {dtype} batch {batch}")
                    return "partial"
                what = {"arch": arch, "dtype": dtype, "batch": batch, "loaded": plan.loaded}
                report.attempt("routed vs R(n)", what, _routed, arch, dtype, batch, weights, plan)
    # At scale: the largest arch with ``huge_loaded`` resident (adapters sharing a bank's values).
    arch, dtype, batch = plan.archs[-1], plan.dtypes[0], plan.batches[0]
    if not report.room(budget, 60):
        report.note(f"budget spent: stopped before {plan.huge_loaded:,} resident")
        return "partial"
    what = {"arch": arch, "dtype": dtype, "batch": batch, "loaded": plan.huge_loaded}
    report.attempt("routed vs R(n)", what, _routed, arch, dtype, batch, None, plan)
    return "done"


def _routed(arch: str, dtype: str, batch: int, weights: list | None, plan: Plan) -> dict:
    """``weights`` None: ``plan.huge_loaded`` adapters of a bank (bank_adapters)."""
    e = engine(arch, plan, dtype)
    x = images(e, batch)
    started = time.perf_counter()
    weights = bank_adapters(e, plan.huge_loaded, 1, plan.classes) if weights is None else weights
    loaded = LiveAdapters(e).install(e.prepare_set(weights))
    installed = time.perf_counter() - started
    rng = random.Random(batch)
    # As a server hands a batch to the engine: set positions, built per request before the pass.
    one = TaskIndex.from_names(loaded, [[rng.choice(loaded.names)] for _ in range(batch)])
    eight = TaskIndex.from_names(
        loaded, [rng.sample(loaded.names, min(8, len(loaded))) for _ in range(batch)]
    )
    with torch.inference_mode():
        times = timed_rounds(
            {
                "base": lambda: e(x),
                "1": lambda: e(x, loaded, tasks=one),
                "8": lambda: e(x, loaded, tasks=eight),
            },
            plan.device,
            plan.rounds,
        )
    r1, r8 = (flop_ratio(e.spec, uniform_adapters(n, 1, plan.classes)) for n in (1, min(8, len(loaded))))
    over1, over8 = ratio(times, "1", "base") / r1, ratio(times, "8", "base") / r8
    return {
        "base_img_s": rate(times["base"], batch),
        "1 task: img/s": rate(times["1"], batch),
        "1 task: (t/base)/R(1)": over1,
        "goal <= 1.10": goal(over1, "<=", 1.10),
        "8 tasks: img/s": rate(times["8"], batch),
        "8 tasks: (t/base)/R(8)": over8,
        "made, prepared and installed s": installed,
    }


def run_memory(plan: Plan, report: StepReport, budget: Budget) -> str:
    arch = plan.archs[-1]  # the largest of the main shapes (ViT-B/16 on the GPU)
    weights = adapters(engine(arch, plan), max(plan.memory_ks), 1, plan.classes)
    for dtype in plan.dtypes[:2]:
        for k in (*plan.memory_ks, plan.huge_loaded):
            if not report.room(budget, 45):
                report.note(f"budget spent: stopped before {dtype} K={k}")
                return "partial"
            what = {"arch": arch, "dtype": dtype, "K": k, "batch": plan.memory_batch}
            few = k <= len(weights)
            report.attempt("peak memory", what, _memory, arch, dtype, weights[:k] if few else k, plan)
    return "done"


# Past this many resident, the all-tasks pass is not run (100,000 on ViT-B/16 would need ~160 GB).
EVERY_MOST = 20_000


def _memory(arch: str, dtype: str, weights: list | int, plan: Plan) -> dict:
    """``weights``: the adapters, or how many of a bank's (bank_adapters) to make on the device."""
    e = engine(arch, plan, dtype)
    x = images(e, plan.memory_batch)
    cuda = plan.device.type == "cuda"
    before = torch.cuda.memory_allocated(plan.device) if cuda else 0
    if isinstance(weights, int):
        weights = bank_adapters(e, weights, 1, plan.classes)
    loaded = LiveAdapters(e).install(e.prepare_set(weights))
    sync(plan.device)
    held = (torch.cuda.memory_allocated(plan.device) - before) / 2**20 if cuda else None
    rng = random.Random(0)
    # As a server hands a batch to the engine: set positions, built per request before the pass.
    one = TaskIndex.from_names(loaded, [[rng.choice(loaded.names)] for _ in range(len(x))])
    passes = {"base": lambda: e(x), "routed": lambda: e(x, loaded, tasks=one)}
    if len(loaded) <= EVERY_MOST:
        passes["every"] = lambda: e(x, loaded)
    with torch.inference_mode():
        e.cuda_graphs = False  # what a pass needs while it runs, not what its graph keeps (below)
        peaks = {name: peak_mib(fn, plan.device) for name, fn in passes.items()}
        e.cuda_graphs = True
        row = {"set held MiB": held, "slot pools MiB": e.slots.pools.nbytes / 2**20}
        row["base pass MiB"] = peaks["base"]["peak_over_resident_mib"]
        row["routed, 1 task/image MiB"] = peaks["routed"]["peak_over_resident_mib"]
        every = peaks.get("every", {})
        row["unrouted, all K MiB"] = every.get("peak_over_resident_mib")
        if cuda:
            row["unrouted: device peak MiB"] = every.get("peak_mib")
            # Captures each pass's graph into the engine's private pool (graphs.py), whose segments the
            # allocator reserves for the graphs alone: what serving these shapes keeps on the device.
            before = torch.cuda.memory_reserved(plan.device)
            for fn in passes.values():
                fn()
            sync(plan.device)
            row["graphs reserve MiB"] = (torch.cuda.memory_reserved(plan.device) - before) / 2**20
    return row
