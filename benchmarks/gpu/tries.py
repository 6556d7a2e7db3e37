"""The engine step's tries: variants of the pass against the default, each reported with its gain.

- ``sdpa``: each SDPA backend for the base path, memvit against timm under it and whether memvit stays
  bitwise timm's. Eager, both: a CUDA graph replays the kernels of the backend it was captured under.
- ``graphs``: what CUDA graphs gain, ``engine.cuda_graphs`` on against off, for the fused pass at
  K = 64 and a routed pass (1 task per image of ``Plan.loaded`` resident);
- ``kernels``: the Triton kernels against the torch ones for the same two passes, graphed as served,
  and the largest difference between their logits;
- ``gemms``: the linear layers' products over the base and class-token rows joined (the default) or
  apart (``engine.row_gemms``: the base rows' on the base pass's own shape, so the GEMM library picks
  the base's tiles), for fused K = 8 and routed 8 of ``Plan.loaded`` per image: wall (graphed) and
  GPU-busy ms of each and of the base alone, the top kernels, and whether the base stays timm's
  (decided: joined stays the default, docs/gpu.md; run on request);
- ``ahead``: a planned pass as one graph (the default) or two (``engine.embed_ahead``: the patch
  embedding's graph launched before the plan, so that the device embeds while the host plans), for
  routed 1 and 8 of ``Plan.loaded`` per image and fused K = 8: wall ms (graphed, synced) of each
  and of the base alone, the host's time to the first launch, and whether the logits are the same.
- ``tiles``: the Triton kernels' tiles chosen to fit the registers (the default, kernel_tiles.py:
  nothing spilled when compiled for sm_90) against the tiles before (``wide``: 2.7 KB a thread
  spilled in the all-tasks pass with Triton 3.6), 16-row tiles throughout (``narrow``: twice the
  programs per SM) and 64-row tiles on 16 warps (``deep``), for fused K = ``Plan.loaded`` and routed
  8 of it per image, eager (a graph replays the kernels it was captured with): wall and GPU-busy ms
  of each, the top kernels, and the largest difference between their logits.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from memvit.memory_core import AdapterSet, FusedOutput, LiveAdapters, MemoryViT, TaskIndex

from .plan import Plan, rate, ratio, timed_rounds
from .profiling import profiled_pass
from .report import Budget, StepReport

FUSED_K = 64


def run(
    e: MemoryViT, x: torch.Tensor, weights: list, plan: Plan, report: StepReport, budget: Budget, what: dict
) -> None:
    loaded = e.prepare_set(weights[: plan.loaded])
    LiveAdapters(e).install(loaded)  # every adapter resident in a slot, as a server holds them
    rng = random.Random(len(x))
    # As a server hands a batch to the engine: set positions, built per request before the pass.
    one = TaskIndex.from_names(loaded, [[rng.choice(loaded.names)] for _ in range(len(x))])
    fused = AdapterSet(loaded.adapters[:FUSED_K])  # the same prepared adapters: their slots are shared
    passes: dict[str, Callable[[], FusedOutput]] = {
        f"fused K={len(fused)}": lambda: e(x, fused),
        f"routed 1 of {len(loaded)}": lambda: e(x, loaded, tasks=one),
    }
    for name in plan.tries:
        if not budget.allows(30):
            report.note(f"budget spent: try {name} not run on {what}")
            return
        if name == "sdpa":
            for backend in _sdpa_backends(plan.device):
                row = {**what, "backend": backend.name}
                report.attempt("try: SDPA backend, base path", row, _sdpa, e, x, backend, plan)
        elif name == "gemms":
            for label, fn in _eight_passes(e, x, loaded, rng).items():
                row = {**what, "pass": label}
                report.attempt("try: row products joined vs apart", row, _gemms, e, fn, x, plan)
        elif name == "ahead":
            routed = {f"routed 1 of {len(loaded)}": passes[f"routed 1 of {len(loaded)}"]}
            for label, fn in {**routed, **_eight_passes(e, x, loaded, rng)}.items():
                row = {**what, "pass": label}
                report.attempt("try: embedding ahead of the plan", row, _ahead, e, fn, x, plan)
        elif name == "tiles":
            eight = list(_eight_passes(e, x, loaded, rng).items())[-1:]  # routed: fused K = 8's tiles too
            tiled = dict([(f"fused K={len(loaded)}", lambda: e(x, loaded)), *eight])
            if plan.smoke:  # the interpreter runs a pass in ~1 s: one pass says the try works
                tiled = dict(eight)
            for label, fn in tiled.items():
                row = {**what, "pass": label}
                report.attempt("try: kernel tiles in registers vs wide", row, _tiles, e, fn, plan)
        elif name in ("graphs", "kernels"):
            table = "try: CUDA graphs on vs off" if name == "graphs" else "try: Triton vs torch kernels"
            measure = _graphs if name == "graphs" else _kernels
            for label, fn in passes.items():
                report.attempt(table, {**what, "pass": label}, measure, e, fn, len(x), plan)
        else:
            report.note(f"unknown try {name!r}: known are sdpa, graphs, kernels, gemms, ahead, tiles")


@contextmanager
def _setting(e: MemoryViT, **values: Any) -> Iterator[None]:
    """The engine with ``values`` set for the block, restored after."""
    before = {name: getattr(e, name) for name in values}
    for name, value in values.items():
        setattr(e, name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(e, name, value)


def _with(e: MemoryViT, fn: Callable[[], FusedOutput], **values: Any) -> Callable[[], FusedOutput]:
    def call() -> FusedOutput:
        with _setting(e, **values):
            return fn()

    return call


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

    with sdpa_kernel([backend]), _setting(e, cuda_graphs=False):
        times = timed_rounds({"timm": lambda: e.base(x), "memvit": lambda: e(x)}, plan.device, plan.rounds)
        same = torch.equal(e(x).base, e.base(x))
    return {
        "memvit_img_s": rate(times["memvit"], len(x)),
        "memvit/timm": ratio(times, "timm", "memvit"),
        "bitwise vs timm": same,
    }


def _graphs(e: MemoryViT, fn: Callable[[], FusedOutput], batch: int, plan: Plan) -> dict:
    captured = e._graphs().captures if e.graphed else 0
    times = timed_rounds(
        {"off": _with(e, fn, cuda_graphs=False), "on": _with(e, fn, cuda_graphs=True)},
        plan.device,
        plan.rounds,
    )
    return {
        "graphed": e.graphed,  # False off CUDA: both columns then run the same eager pass
        "off_img_s": rate(times["off"], batch),
        "on_img_s": rate(times["on"], batch),
        "on/off img/s": ratio(times, "off", "on"),
        "captures": (e._graphs().captures - captured) if e.graphed else 0,
    }


def _kernels(e: MemoryViT, fn: Callable[[], FusedOutput], batch: int, plan: Plan) -> dict:
    last: dict[str, FusedOutput] = {}  # each implementation's last output, compared below

    def kept(kernels: str) -> Callable[[], None]:
        run = _with(e, fn, kernels=kernels)

        def call() -> None:
            last[kernels] = run()

        return call

    # Not a pass more than the timing's: on CPU the Triton kernels run in Triton's (slow) interpreter.
    times = timed_rounds({"torch": kept("torch"), "triton": kept("triton")}, plan.device, plan.rounds)
    a, b = last["torch"], last["triton"]
    diff = max((a.adapters[n].float() - b.adapters[n].float()).abs().max().item() for n in a.adapters)
    return {
        "graphed": e.graphed,
        "torch_img_s": rate(times["torch"], batch),
        "triton_img_s": rate(times["triton"], batch),
        "torch/triton time": ratio(times, "torch", "triton"),
        "max diff": diff,
    }


def _eight_passes(
    e: MemoryViT, x: torch.Tensor, loaded: AdapterSet, rng: random.Random
) -> dict[str, Callable[[], FusedOutput]]:
    """Fused K = 8 and routed 8 of ``loaded`` per image: where the rows' products cost most."""
    eight = TaskIndex.from_names(
        loaded, [rng.sample(loaded.names, min(8, len(loaded))) for _ in range(len(x))]
    )
    fused = AdapterSet(loaded.adapters[:8])
    return {
        f"fused K={len(fused)}": lambda: e(x, fused),
        f"routed 8 of {len(loaded)}": lambda: e(x, loaded, tasks=eight),
    }


def _gemms(e: MemoryViT, fn: Callable[[], FusedOutput], x: torch.Tensor, plan: Plan) -> dict:
    last: dict[str, FusedOutput] = {}

    def kept(gemms: str) -> Callable[[], None]:
        run = _with(e, fn, row_gemms=gemms)

        def call() -> None:
            last[gemms] = run()

        return call

    calls = {"base": lambda: e(x), "joined": kept("joined"), "apart": kept("apart")}
    times = timed_rounds(calls, plan.device, plan.rounds)
    busy = {name: profiled_pass(call, plan, None) for name, call in calls.items()}
    a, b = last["joined"], last["apart"]
    diff = max((a.adapters[n].float() - b.adapters[n].float()).abs().max().item() for n in a.adapters)
    timm = e.base(x)
    row: dict = {"graphed": e.graphed}
    for name in calls:
        row[f"{name} ms"] = statistics.median(times[name]) * 1e3
    for name in calls:
        row[f"{name} busy ms"] = busy[name]["GPU busy ms"]
    row["apart/joined time"] = ratio(times, "apart", "joined")
    if busy["joined"]["GPU busy ms"]:  # None on CPU
        row["apart/joined busy"] = busy["apart"]["GPU busy ms"] / busy["joined"]["GPU busy ms"]
    row["copies joined, apart"] = f"{busy['joined']['copies']}, {busy['apart']['copies']}"
    row["base bitwise timm: joined, apart"] = f"{torch.equal(a.base, timm)}, {torch.equal(b.base, timm)}"
    row["max diff"] = diff
    row["top kernels apart"] = busy["apart"]["top kernels (us/pass)"]
    return row


def _ahead(e: MemoryViT, fn: Callable[[], FusedOutput], x: torch.Tensor, plan: Plan) -> dict:
    last: dict[str, FusedOutput] = {}

    def kept(ahead: bool) -> Callable[[], None]:
        run = _with(e, fn, embed_ahead=ahead)

        def call() -> None:
            last[str(ahead)] = run()

        return call

    calls = {"base": lambda: e(x), "one graph": kept(False), "ahead": kept(True)}
    times = timed_rounds(calls, plan.device, plan.rounds)
    parts = {name: profiled_pass(call, plan, None) for name, call in calls.items()}
    a, b = last["False"], last["True"]
    row: dict = {"graphed": e.graphed}
    for name in calls:
        row[f"{name} ms"] = statistics.median(times[name]) * 1e3
    for name in calls:
        row[f"{name}: host to launch ms"] = parts[name].get("host to launch ms")
    row["ahead/one graph time"] = ratio(times, "ahead", "one graph")
    row["(ahead - base) ms"] = row["ahead ms"] - row["base ms"]
    row["same logits"] = torch.equal(a.base, b.base) and all(
        torch.equal(a.adapters[n], b.adapters[n]) for n in a.adapters
    )
    return row


def _tiles(e: MemoryViT, fn: Callable[[], FusedOutput], plan: Plan) -> dict:
    from memvit.memory_core.routing import kernel_tiles

    last: dict[str, FusedOutput] = {}

    def kept(tiles: str) -> Callable[[], None]:
        run = _with(e, fn, cuda_graphs=False, kernels="triton")

        def call() -> None:
            before, kernel_tiles.TILES = kernel_tiles.TILES, tiles
            try:
                last[tiles] = run()
            finally:
                kernel_tiles.TILES = before

        return call

    calls = {name: kept(name) for name in ("registers", "wide", "narrow", "deep")}
    busy = {name: profiled_pass(call, plan, None) for name, call in calls.items()}  # timed, then recorded
    a, others = last["registers"], list(calls)[1:]
    row: dict = {"graphed": False}
    for name in calls:
        row[f"{name} ms"] = busy[name]["wall ms"]
        row[f"{name} busy ms"] = busy[name]["GPU busy ms"]
    for other in others:
        row[f"{other}/registers time"] = busy[other]["wall ms"] / busy["registers"]["wall ms"]
        if busy["registers"]["GPU busy ms"]:  # None on CPU
            row[f"{other}/registers busy"] = busy[other]["GPU busy ms"] / busy["registers"]["GPU busy ms"]
    row["max diff"] = max(
        (a.adapters[n].float() - last[other].adapters[n].float()).abs().max().item()
        for other in others for n in a.adapters
    )  # fmt: skip
    for name in calls:
        row[f"top kernels {name}"] = busy[name]["top kernels (us/pass)"]
    return row
