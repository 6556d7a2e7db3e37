"""Step ``invariance``: the batch-invariant mode on the device (memory_core/invariant/mode.py).

Which ops change with the batch here (benchmarks/batch_invariance.py's probe, on this device), then
per base, dtype and batch: img/s of the invariant mode against the default (base alone, 8 adapters,
routed), and whether image 0's logits alone equal its logits in the batch, bitwise, in each mode.
On CUDA the mode's block sizes can be tried at other values, each checked the same way (``tried``:
none now; 16 class-token rows per program of the Triton attention held against 64 on an H200).
"""

from __future__ import annotations

from functools import partial

import torch

from benchmarks.batch_invariance import bench, op_probe
from memvit.memory_core.invariant.blocks import InvariantBlocks
from tests.factories import random_adapter

from .plan import ARCHS, DTYPES, Plan, engine, images, timed_rounds
from .report import Budget, StepReport, goal


def tried(device: torch.device, dtype: str) -> tuple[InvariantBlocks, ...]:
    """On CUDA, blocks other than the defaults, each checked (base, routed and all-tasks adapters) and
    timed against the default blocks and the default (not invariant) mode. The tries so far (larger
    calls, the per-token layers whole, the patch embedding blocked alone, the Triton attention on a
    16-row tile, then on a 64-row one) decided the defaults (benchmarks/RESULTS.md §1.6, docs/gpu.md):
    64 rows held bitwise but ran the all-tasks pass at 0.95 (bf16) and 0.84-0.92 (fp32) of 16's on an
    H200, so none is tried now; name a new candidate here."""
    return ()


def run(plan: Plan, report: StepReport, budget: Budget) -> str:
    for name, same in op_probe(str(plan.device)):
        report.add("ops: alone == in batches of 2..32", {"op": name, "invariant by itself": same})
    timing = partial(timed_rounds, device=plan.device)
    for arch in plan.archs:
        spec = dict(ARCHS[arch])
        name = spec.pop("arch", arch)
        for dtype in plan.dtypes:
            for batch in plan.batches:
                if not budget.allows(30):
                    report.note(f"budget spent: stopped before {arch} {dtype} batch {batch}")
                    return "partial"
                what = {"arch": arch, "dtype": dtype, "batch": batch}

                def rows(name=name, dtype=dtype, batch=batch, spec=spec) -> list[dict]:
                    return bench(
                        name,
                        batch,
                        plan.rounds,
                        str(plan.device),
                        DTYPES[dtype],
                        timing=lambda f, r: timing(f, rounds=r),
                        **spec,
                    )

                try:
                    for row in rows():
                        row.pop("arch"), row.pop("batch")
                        report.add(
                            "invariant vs default",
                            {**what, **row, "goal: holds": goal(row["invariant_holds"], "==", True)},
                        )
                except Exception as exc:  # recorded, and on to the next setting
                    report.add("invariant vs default", {**what, "error": repr(exc)[:500]})
        if plan.device.type == "cuda":
            for dtype in plan.dtypes:
                for blocks in tried(plan.device, dtype):
                    if budget.allows(30):
                        report.attempt(
                            "try: block sizes",
                            {"arch": arch, "dtype": dtype, "blocks": str(blocks)},
                            _blocks,
                            arch,
                            blocks,
                            plan,
                            dtype,
                        )
    return "done"


def _blocks(arch: str, blocks: InvariantBlocks, plan: Plan, dtype: str) -> dict:
    e = engine(arch, plan, dtype, batch_invariant=True)
    default = engine(arch, plan, dtype, batch_invariant=True)
    e.invariant_blocks = blocks
    plain = engine(arch, plan, dtype)
    x = images(e, max(plan.batches))
    weights = [random_adapter(f"a{i}", e, m=1 + i % 3, classes=10) for i in range(8)]
    adapters, default_set, plain_set = (g.prepare_set(weights) for g in (e, default, plain))
    asks = [["a1", "a5"]] + [[f"a{i % 8}"] for i in range(1, len(x))]  # image 0's rows: its own
    with torch.inference_mode():
        sizes = (2, 7, 33, len(x))
        holds = all(torch.equal(e(x[:1]).base[0], e(x[:n]).base[0]) for n in sizes)
        alone = e(x[:1], adapters, tasks=asks[:1])
        holds_adapters = all(
            torch.equal(alone.adapters[a][0], e(x[:n], adapters, tasks=asks[:n]).adapters[a][0])
            for n in sizes
            for a in ("a1", "a5")
        )
        every = e(x[:1], adapters)  # the all-tasks pass: 8 rows per image
        holds_every = all(
            torch.equal(every.adapters[a][0], e(x[:n], adapters).adapters[a][0])
            for n in sizes
            for a in ("a1", "a5")
        )
        times = timed_rounds(
            {
                "default blocks": lambda: default(x),
                "these": lambda: e(x),
                "default mode": lambda: plain(x),
                "all: default blocks": lambda: default(x, default_set),
                "all: these": lambda: e(x, adapters),
                "all: default mode": lambda: plain(x, plain_set),
            },
            plan.device,
            plan.rounds,
        )
    return {
        "holds (base)": holds,
        "holds (routed adapters)": holds_adapters,
        "holds (8 adapters, all)": holds_every,
        "speed vs default blocks": sum(times["default blocks"]) / sum(times["these"]),
        "of the default mode (goal >= 0.8)": sum(times["default mode"]) / sum(times["these"]),
        "8 adapters: speed vs default blocks": sum(times["all: default blocks"]) / sum(times["all: these"]),
        "8 adapters: of the default mode": sum(times["all: default mode"]) / sum(times["all: these"]),
    }
