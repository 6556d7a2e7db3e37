"""Routing: an image pays for the base pass plus the tasks it asks for, whatever else is loaded.

For each base (ViT-B/32, DeiT-Tiny; random init: the cost does not depend on the weights) and K
loaded adapters (m memory tokens, 100 classes): a batch of 16 images where each image asks for 1
random task, 8 random tasks, or all of them (the unrouted pass), timed in interleaved rounds against
the plain base pass (no adapters), and compared with the analytic FLOP ratio R(n) of n adapters
(memory_core/flops.py). The "all" mode is skipped where it would take minutes (K = 1,000 on CPU).

    python -m benchmarks.routing
    python -m benchmarks.routing --archs deit_tiny_patch16_224 --counts 1 64 --rounds 5
"""

from __future__ import annotations

import random

import torch

from memory_core import MemoryViT, flop_ratio, uniform_adapters
from tests.factories import random_adapter

from .common import argument_parser, environment, interleaved, median_ratio, pin_malloc


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--archs", nargs="+", default=["vit_base_patch32_224", "deit_tiny_patch16_224"])
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 64, 1000])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--memory", type=int, default=1)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--all-up-to", type=int, default=64, help="largest K to time the all-tasks pass at")
    args = parser.parse_args(argv)
    print(environment(pin_malloc(), f"batch {args.batch}, m={args.memory}, {args.classes} classes"))
    torch.set_grad_enabled(False)
    print("| base | K loaded | asked per image | fused / base (median) | R(asked) | fused / R |")
    print("|---|---:|---:|---:|---:|---:|")
    for arch in args.archs:
        plain = MemoryViT.from_timm(arch)
        engine = MemoryViT.from_timm(arch)
        engine.base.load_state_dict(plain.base.state_dict())
        x = torch.randn(args.batch, 3, *engine.spec.img_size)
        for count in args.counts:
            engine.set_adapters(
                random_adapter(f"a{i}", engine, m=args.memory, classes=args.classes) for i in range(count)
            )
            names = list(engine.adapters.names)
            rng = random.Random(count)
            one = [[rng.choice(names)] for _ in range(args.batch)]
            eight = [rng.sample(names, min(8, count)) for _ in range(args.batch)]
            fns = {
                "base": lambda plain=plain, x=x: plain(x),
                "1": lambda engine=engine, x=x, one=one: engine(x, tasks=one),
                "8": lambda engine=engine, x=x, eight=eight: engine(x, tasks=eight),
            }
            if count <= args.all_up_to:
                fns["all"] = lambda engine=engine, x=x: engine(x)
            times = interleaved(fns, args.rounds)
            for mode in ("1", "8", "all"):
                if mode not in times:
                    continue
                asked = {"1": 1, "8": min(8, count), "all": count}[mode]
                ratio = median_ratio(times, mode, "base")
                floor = flop_ratio(engine.spec, uniform_adapters(asked, args.memory, args.classes))
                print(
                    f"| {arch} | {count:,} | {mode} | {ratio:.3f} | {floor:.3f} | {ratio / floor:.3f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
