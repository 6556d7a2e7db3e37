"""Step ``profile``: what one pass launches and waits for, with ``torch.profiler``.

Per base shape (the plan's first dtype and batch: DeiT-Tiny, then ViT-B/16 while the budget allows)
and pass (the base alone; fused K = 8; routed, 1 and 8 tasks per image of ``Plan.loaded`` resident),
with CUDA graphs on and off: kernels, launch calls, host synchronisations and copies per pass
(trace.py says what each counts), wall ms per pass (median of synced calls, profiler off) against
GPU-busy ms (union of the kernels' intervals, profiler on), and on CUDA where the difference goes
(``gap_parts``: the host's time to the first launch, the device's own gaps between its nodes; and
the goal's wall minus busy taken from the same profiled passes, each synced alone).

With graphs on, the host makes one ``cudaGraphLaunch`` per replay: the launch calls show that, and
the kernels column shows the graph's kernels where the profiler (CUPTI) reports them. On CPU there
are no kernels nor graphs: the pass runs eager, leaf aten ops stand in for kernels and the aten ops
that would make a GPU wait for the host stand in for host syncs. The first shape's routed pass of 8
tasks is kept as a gzipped Chrome trace beside the report (chrome://tracing, Perfetto).
"""

from __future__ import annotations

import gzip
import json
import random
import shutil
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from memvit.memory_core import AdapterSet, LiveAdapters, MemoryViT, TaskIndex

from .plan import Plan, adapters, engine, images, sync, timed_rounds
from .report import Budget, StepReport, goal
from .trace import busy_us, summarize

PASS_MARK = "benchmark: one recorded pass"
TABLE = "one pass, profiled"


def run(plan: Plan, report: StepReport, budget: Budget) -> str:
    cuda = plan.device.type == "cuda"
    dtype = plan.dtypes[0]
    report.note(
        "kernels, launch calls, graph launches, copies and host syncs per pass from torch.profiler "
        "(benchmarks/gpu/trace.py); wall ms: median synced call with the profiler off; GPU busy ms: "
        "union of kernel intervals with it on; the goal's wall - busy from the same profiled passes "
        "(each synced alone: its start to its device work's end, less its kernels)"
        + (
            ""
            if cuda
            else "; on CPU: leaf aten ops stand in for kernels, syncing aten ops for host syncs, eager only"
        )
    )
    for index, arch in enumerate(plan.archs):
        if not report.room(budget, 30):
            report.note(f"budget spent: stopped before {arch}")
            return "partial"
        e = engine(arch, plan, dtype)
        for batch in plan.batches:
            if not _profile_batch(e, arch, dtype, batch, plan, report, budget, trace=index == 0):
                return "partial"
    return "done"


def _profile_batch(
    e: MemoryViT,
    arch: str,
    dtype: str,
    batch: int,
    plan: Plan,
    report: StepReport,
    budget: Budget,
    trace: bool,
) -> bool:
    """Every pass at one batch size, graphed and (on CUDA) eager; False: the budget ran out."""
    passes = _passes(e, images(e, batch), plan)
    with torch.inference_mode():
        for graphs in (True, False) if plan.device.type == "cuda" else (False,):
            e.cuda_graphs = graphs
            base_gap = None
            for name, fn in passes.items():
                if not report.room(budget, 15):
                    report.note(f"budget spent: stopped before {arch} batch {batch} {name}")
                    return False
                keep = None
                if trace and batch == plan.batches[0] and name.startswith("routed, 8"):
                    keep = report.out / f"trace-{arch}-routed8-graphs-{'on' if graphs else 'off'}.json.gz"
                what = {"arch": arch, "dtype": dtype, "batch": batch, "CUDA graphs": e.graphed, "pass": name}
                if report.attempt(TABLE, what, profiled_pass, fn, plan, keep):
                    known = base_gap if name != "base only" else None
                    base_gap = _against_base(report.tables[TABLE][-1], known)
    return True


def _against_base(row: dict, base_gap: float | None) -> float | None:
    """The engine's goal on a row: a planned pass's wall minus GPU-busy within 0.05 ms of the base
    pass's, both from this run (the base pass comes first in each mode), each from the same profiled
    passes where the trace has them (on CUDA): the median synced call (profiler off) against one
    recording's busy time moved by up to 0.5 ms between runs of the same code. Returns the base's."""
    same = row.get("wall - busy ms, same pass")
    gap = same if same is not None else row.get("wall - busy ms")
    if base_gap is None or gap is None:
        return gap  # the base pass (or a CPU row, which has no busy time)
    row["over base's ms"] = gap - base_gap
    row["goal <= 0.05"] = goal(gap - base_gap, "<=", 0.05)
    return base_gap


def _passes(e: MemoryViT, x: torch.Tensor, plan: Plan) -> dict[str, Callable[[], object]]:
    """The passes profiled, with ``plan.loaded`` adapters resident (installed in their slots)."""
    batch = len(x)
    loaded = LiveAdapters(e).install(e.prepare_set(adapters(e, plan.loaded, 1, plan.classes)))
    rng = random.Random(batch)
    # As a server hands a batch to the engine: set positions, built per request before the pass.
    one = TaskIndex.from_names(loaded, [[rng.choice(loaded.names)] for _ in range(batch)])
    eight = TaskIndex.from_names(
        loaded, [rng.sample(loaded.names, min(8, len(loaded))) for _ in range(batch)]
    )
    fused = AdapterSet(loaded.adapters[:8])  # the same prepared adapters: their slots are shared
    n = f"{len(loaded):,}"
    return {
        "base only": lambda: e(x),
        "fused, K = 8": lambda: e(x, fused),
        f"fused, K = {n}": lambda: e(x, loaded),
        f"routed, 1 of {n} per image": lambda: e(x, loaded, tasks=one),
        f"routed, 8 of {n} per image": lambda: e(x, loaded, tasks=eight),
    }


def profiled_pass(fn: Callable[[], object], plan: Plan, keep: Path | None) -> dict:
    """One pass's row of the table: timed, then ``plan.profiled`` passes recorded (kept at ``keep``)."""
    cuda = plan.device.type == "cuda"
    times = timed_rounds({"pass": fn}, plan.device, plan.rounds)  # warms up (and captures) first
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as recorded:
        for _ in range(plan.profiled):
            with record_function(PASS_MARK):
                fn()
            sync(plan.device)  # outside the mark: each pass alone, as a synced call runs it
    with tempfile.TemporaryDirectory(prefix="memvit-profile-") as tmp:
        path = Path(tmp) / "trace.json"
        recorded.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
        if keep is not None:
            with path.open("rb") as source, gzip.open(keep, "wb") as target:
                shutil.copyfileobj(source, target)
    counts = summarize(events, plan.profiled, mark=PASS_MARK, gpu=cuda)
    wall = statistics.median(times["pass"]) * 1e3
    busy = counts["GPU busy ms"]
    return {
        "wall ms": wall,
        **counts,
        "GPU busy / wall": None if busy is None else busy / wall,
        "wall - busy ms": None if busy is None else wall - busy,
        **(gap_parts(events) if cuda else {}),
    }


def gap_parts(events: list[dict]) -> dict[str, float | None]:
    """Where a pass's wall time beyond its kernels goes, median over the recorded passes (profiler
    on, so upper bounds): the host's time from the pass's start to its first launch (what a synced
    pass waits for with the GPU idle: the plan, the copies), and, of the device work that launch
    and the copies started, the span from its first start to its last end minus the union of
    kernels, memsets and copies: the device's own gaps between nodes."""
    marks = [e for e in events if e.get("cat") == "user_annotation" and e.get("name") == PASS_MARK]
    host = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    device = {}
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy"):
            device.setdefault(e.get("args", {}).get("correlation"), []).append(e)
    to_launch, gaps, beyond = [], [], []
    for mark in marks:
        inside = [h for h in host if mark["ts"] <= h["ts"] <= mark["ts"] + mark.get("dur", 0.0)]
        launches = [h for h in inside if h["name"].startswith(("cudaGraphLaunch", "cudaLaunchKernel"))]
        if launches:
            to_launch.append(min(h["ts"] for h in launches) - mark["ts"])
        work = [d for h in inside for d in device.get(h.get("args", {}).get("correlation"), [])]
        if work:
            spans = [(d["ts"], d["ts"] + d.get("dur", 0.0)) for d in work]
            gaps.append(max(b for _, b in spans) - min(a for a, _ in spans) - busy_us(spans))
            # the pass alone (the device idle at its start): its start to its device work's end,
            # less its kernels' union; wall and busy from the same pass, unlike the columns above
            kernels = [(a, b) for (a, b), d in zip(spans, work, strict=True) if d["cat"] == "kernel"]
            beyond.append(max(b for _, b in spans) - mark["ts"] - busy_us(kernels))
    median = statistics.median
    return {
        "host to launch ms": median(to_launch) / 1e3 if to_launch else None,
        "device gaps ms": median(gaps) / 1e3 if gaps else None,
        "wall - busy ms, same pass": median(beyond) / 1e3 if beyond else None,
    }
