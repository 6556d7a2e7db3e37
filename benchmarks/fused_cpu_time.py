"""The fused pass against the base pass in per-thread CPU time, for a shared, noisy machine.

    python -m benchmarks.fused_cpu_time                                   # ViT-B/32, all 8 tasks
    python -m benchmarks.fused_cpu_time --arch deit_tiny_patch16_224 --routed 1 --reps 20

One intra-op thread, so a pass's CPU time is its own thread's (``time.thread_time``): time the
process spends descheduled by other work does not count, which wall-clock ratios on a shared 2-core
machine cannot say (benchmarks/RESULTS.md §1.0). Passes in interleaved repetitions, every other one
in reverse order: timm's base pass, the fused pass as served (on the CPU its last block over the
rows a head reads only: ``trim_last_block``) and the variants ``--also`` names: ``whole`` (the whole
last block, the like-for-like overhead over R), ``trim`` (trimmed whatever the default),
``apart`` (``row_gemms = "apart"``: each linear layer as two products, the base rows' on the base
pass's shape and the class-token rows' thin). Prints each one's median and the
median of per-repetition ratios to the base, against the analytic R. Memory stalls from other
processes' cache traffic still count: compare runs of one sitting, not across evenings.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from memvit.memory_core import MemoryViT, flop_ratio, uniform_adapters
from tests.factories import random_adapter

from .common import argument_parser, environment, interleaved, median_ratio, pin_malloc


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--arch", default="vit_base_patch32_224")
    parser.add_argument("--k", type=int, default=8, help="adapters loaded (memory 1, 1000 classes)")
    parser.add_argument("--routed", type=int, default=0, help="tasks per image (0: every task)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument(
        "--also", nargs="*", default=["whole"], choices=["whole", "trim", "apart"], help="variants"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    print(environment(pin_malloc(), f"batch {args.batch}, 1 thread, thread CPU time, {args.reps} reps"))
    torch.manual_seed(0)
    engine = MemoryViT.from_timm(args.arch)
    adapters = [random_adapter(f"a{i}", engine, m=1, classes=1000, memory_std=0.02) for i in range(args.k)]
    loaded = engine.prepare_set(adapters)
    x = torch.randn(args.batch, 3, *engine.spec.img_size)
    tasks = None
    if args.routed:
        names = loaded.names
        tasks = [[names[(7 * b + j) % len(names)] for j in range(args.routed)] for b in range(args.batch)]
    r = flop_ratio(engine.spec, uniform_adapters(args.routed or args.k, 1, 1000))

    def fused(trim: bool | None = None, gemms: str = "joined"):
        def run() -> None:
            engine.trim_last_block, engine.row_gemms = trim, gemms
            engine(x, loaded, tasks=tasks)

        return run

    variants = {
        "whole": ("fused, whole last block", fused(trim=False)),
        "trim": ("fused, trimmed", fused(trim=True)),
        "apart": ("fused, apart", fused(gemms="apart")),
    }
    fns = {"base": lambda: engine.base(x), "fused": fused(), **dict(variants[v] for v in args.also)}
    times = interleaved(fns, args.reps, clock=time.thread_time, alternate=True)
    what = f"routed {args.routed} of {args.k}" if args.routed else f"all {args.k} tasks"
    print(f"| {args.arch}, {what}, R = {r:.3f} | median ms | / base (median of reps) | over R |")
    print("|---|--:|--:|--:|")
    for name, ts in times.items():
        ratio = median_ratio(times, name, "base")
        over = "-" if name == "base" else f"{ratio / r - 1:+.2%}"
        print(f"| {name} | {statistics.median(ts) * 1e3:.0f} | {ratio:.4f} | {over} |")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
