"""What one block costs with the class-token rows beside the base rows, against timm's block alone.

    python -m benchmarks.block_cost                       # DeiT-Tiny, batch 16, one row per image
    python -m benchmarks.block_cost --arch vit_base_patch32_224 --rows 8 --reps 40

One block of a routed pass (memory_core/block/merged.py), three ways, in interleaved repetitions:
timm's block on the base rows alone; the merged block on the CPU's route (the rows' attention from
the base kernel's log-sum-exp); the merged block with the rows' attention reading the base keys and
values directly (the route elsewhere). Prints each one's median time and the median of per-repetition
ratios to timm's block: the block's excess beyond its FLOPs (R - 1 is about rows / T).
"""

from __future__ import annotations

import os
import statistics

import torch

from memvit.memory_core import LiveAdapters, MemoryViT
from memvit.memory_core.block import merged
from memvit.memory_core.routing.planned import layer_memory, lineage_of, rows_of
from memvit.memory_core.routing.planner import plan_pass
from tests.factories import random_adapter

from .common import argument_parser, environment, interleaved, median_ratio, pin_malloc


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--arch", default="deit_tiny_patch16_224")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rows", type=int, default=1, help="class-token rows per image (tasks asked)")
    parser.add_argument("--reps", type=int, default=40)
    args = parser.parse_args(argv)
    print(environment(pin_malloc(), f"batch {args.batch}, {args.rows} row(s) per image, {args.reps} reps"))
    torch.set_grad_enabled(False)
    e = MemoryViT.from_timm(args.arch)
    live = LiveAdapters(e)
    live.replace_all(random_adapter(f"a{i}", e, m=1, classes=100) for i in range(max(8, args.rows)))
    loaded = live.current
    tasks = [[loaded.names[(b + j) % len(loaded)] for j in range(args.rows)] for b in range(args.batch)]
    plan = plan_pass(loaded, e.slots, tasks, args.batch)
    t, shape, pools = plan.tensors(e.device), plan.shape, plan.pools
    x = e.embed(torch.randn(args.batch, 3, *e.spec.img_size))
    T = x.shape[1]
    z = torch.cat([x, rows_of(pools.cls, t, shape)], dim=1).contiguous()
    bias = rows_of(pools.memory_bias, t, shape, expand=False)
    memory = layer_memory(pools, 0, t, shape, bias, lineage_of(t, shape, z.dtype))
    block = e.base.blocks[0]
    route = merged.summarised

    def merged_block(summarised: bool):
        def run() -> torch.Tensor:
            merged.summarised = route if summarised else (lambda attn, z: False)
            try:
                return merged.merged_block(block, z, T, memory)
            finally:
                merged.summarised = route

        return run

    fns = {
        "timm's block": lambda: block(x),
        "CPU route": merged_block(True),
        "keys read": merged_block(False),
    }
    times = interleaved(fns, args.reps, alternate=True)
    print(f"| {args.arch}, T = {T}, rows {args.rows} | median ms | / timm's block (median of reps) |")
    print("|---|--:|--:|")
    for name, ts in times.items():
        ratio = median_ratio(times, name, "timm's block")
        print(f"| {name} | {statistics.median(ts) * 1e3:.2f} | {ratio:.4f} |")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
