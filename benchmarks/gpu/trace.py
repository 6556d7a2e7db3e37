"""What a ``torch.profiler`` trace (its Chrome trace events) says a run of passes did, per pass.

- kernels: GPU kernel events (category ``kernel``); copies: ``gpu_memcpy`` and ``gpu_memset``;
- launches: the host's kernel-launch calls, runtime and driver (Triton launches through the driver),
  graph launches included, which are also counted alone: a replayed CUDA graph is one
  ``cudaGraphLaunch`` on the host, whatever kernels it holds;
- host syncs: runtime and driver calls that block the host until the device catches up;
- aten ops: leaf ``aten::`` operations (those that call no other), the CPU's stand-in for kernels;
  on CPU the ops that would make a GPU wait for the host stand in for host syncs;
- GPU busy: the union of the kernels' intervals (overlapping kernels count once).

Host calls and aten ops count only inside the ``user_annotation``s named ``mark`` (one around each
recorded pass), so neither the benchmark's own synchronisation after the passes nor the profiler's
own calls are counted; device events (kernels, copies) run after their launch and count all.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

HOST_SYNCS = frozenset(
    {
        "cudaStreamSynchronize",
        "cudaDeviceSynchronize",
        "cudaEventSynchronize",
        "cudaMemcpy",  # the synchronous form; cudaMemcpyAsync to pageable memory syncs too, unseen here
        "cudaMemcpy2D",
        "cuStreamSynchronize",
        "cuCtxSynchronize",
        "cuEventSynchronize",
        "cuMemcpyDtoH",
        "cuMemcpyDtoH_v2",
        "cuMemcpyHtoD",
        "cuMemcpyHtoD_v2",
    }
)
LAUNCH_PREFIXES = (
    "cudaLaunchKernel",
    "cuLaunchKernel",
    "cudaLaunchCooperativeKernel",
    "cudaGraphLaunch",
    "cuGraphLaunch",
)
GRAPH_LAUNCHES = frozenset({"cudaGraphLaunch", "cuGraphLaunch", "cudaGraphLaunch_v10000"})
# aten ops that copy a value to the host or size their output by values: on a GPU, each makes the
# host wait for the device (the planned pass has none: tests/memory_core/routing/test_pass_operations.py).
SYNCING_OPS = frozenset(
    f"aten::{name}"
    for name in (
        "_local_scalar_dense", "item", "nonzero", "unique", "_unique", "_unique2", "unique_consecutive",
        "masked_select", "is_nonzero", "equal", "allclose", "_assert_async",
    )
)  # fmt: skip
HOST_CALLS = ("cuda_runtime", "cuda_driver")


def _spans(events: Iterable[dict[str, Any]]) -> list[tuple[float, float]]:
    return [(e["ts"], e["ts"] + e.get("dur", 0.0)) for e in events]


def busy_us(spans: list[tuple[float, float]]) -> float:
    """Length of the union of the intervals."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def leaf_ops(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``aten::`` ops that contain no other ``aten::`` op (per thread, by their intervals)."""
    by_thread: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    leaves = []
    for ops in by_thread.values():
        ops.sort(key=lambda e: (e["ts"], -e.get("dur", 0.0)))
        stack: list[tuple[float, dict[str, Any]]] = []  # open ops: (end, op)
        parents: set[int] = set()
        for op in ops:
            while stack and stack[-1][0] <= op["ts"]:  # ended before this one starts: not its parent
                stack.pop()
            if stack:
                parents.add(id(stack[-1][1]))
            stack.append((op["ts"] + op.get("dur", 0.0), op))
        leaves += [op for op in ops if id(op) not in parents]
    return leaves


def summarize(events: list[dict[str, Any]], passes: int, *, mark: str, gpu: bool) -> dict[str, Any]:
    """Per-pass figures of ``passes`` passes recorded in ``events`` (a Chrome trace's ``traceEvents``),
    each inside an annotation named ``mark``. ``gpu``: whether the device columns apply (None in
    them otherwise)."""
    complete = [e for e in events if e.get("ph") == "X"]
    marked = _spans(e for e in complete if e.get("cat") == "user_annotation" and e.get("name") == mark)

    def counted(e: dict[str, Any]) -> bool:
        return any(start <= e["ts"] <= stop for start, stop in marked)

    host = [e for e in complete if e.get("cat") in HOST_CALLS and counted(e)]
    aten = [e for e in complete if e.get("cat") == "cpu_op" and e["name"].startswith("aten::") and counted(e)]
    kernels = [e for e in complete if e.get("cat") == "kernel"]
    copies = [e for e in complete if e.get("cat") in ("gpu_memcpy", "gpu_memset")]
    launches = [e for e in host if e["name"].startswith(LAUNCH_PREFIXES)]
    syncs = (
        [e for e in host if e["name"] in HOST_SYNCS] if gpu else [e for e in aten if e["name"] in SYNCING_OPS]
    )

    def per_pass(n: int | float) -> float:
        return n / passes

    return {
        "kernels": per_pass(len(kernels)) if gpu else None,
        "launch calls": per_pass(len(launches)) if gpu else None,
        "graph launches": per_pass(sum(e["name"] in GRAPH_LAUNCHES for e in launches)) if gpu else None,
        "copies": per_pass(len(copies)) if gpu else None,
        "host syncs": per_pass(len(syncs)),
        "aten ops": per_pass(len(leaf_ops(aten))),
        "GPU busy ms": per_pass(busy_us(_spans(kernels))) / 1e3 if gpu and kernels else None,
        # What the copies are (memcpy kinds, memsets) and the kernels that take longest, per pass:
        # where a pass's GPU time goes beyond the base's.
        "copy kinds": _tally(copies, passes) if gpu else None,
        "top kernels (us/pass)": _top(kernels, passes) if gpu else None,
    }


def _tally(events: list[dict[str, Any]], passes: int) -> str:
    counts: dict[str, int] = {}
    for e in events:
        counts[e["name"]] = counts.get(e["name"], 0) + 1
    return "; ".join(f"{name} x{n / passes:g}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def _top(kernels: list[dict[str, Any]], passes: int, most: int = 6) -> str:
    total: dict[str, float] = {}
    for e in kernels:
        name = e["name"][:60]
        total[name] = total.get(name, 0.0) + e.get("dur", 0.0)
    ranked = sorted(total.items(), key=lambda kv: -kv[1])[:most]
    return "; ".join(f"{name} {us / passes:.0f}" for name, us in ranked)
