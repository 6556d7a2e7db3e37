"""Routing: an image pays for the base pass plus the tasks it asks for, whatever else is loaded.

For each base (ViT-B/32, DeiT-Tiny; random init: the cost does not depend on the weights) and K
loaded adapters (m memory tokens, 100 classes): a batch of 16 images where each image asks for 1
random task, 8 random tasks, or all of them (the unrouted pass), timed in interleaved rounds against
the plain base pass (no adapters), and compared with the analytic FLOP ratio R(n) of n adapters
(memory_core/weights/flops.py). The "all" mode is skipped where it would take minutes (K = 1,000 on CPU).

    python -m benchmarks.routing
    python -m benchmarks.routing --archs deit_tiny_patch16_224 --counts 1 64 --rounds 5
    python -m benchmarks.routing --server       # through the HTTP service instead (below)

With ``--server``: ``memvit serve`` (real DeiT-Tiny weights) with 1 adapter in its store, then with
1,000; 32 closed-loop clients each post one real photo per request asking for one random task
(``?tasks=<name>``); alternating rounds, so the machine's drift hits both alike. Prints each round's
throughput and the median share (1,000 loaded over 1 loaded).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

from memvit.memory_core import LiveAdapters, MemoryViT, flop_ratio, uniform_adapters
from tests.factories import random_adapter

from .common import (
    DEIT_TINY,
    argument_parser,
    deit_tiny_engine,
    environment,
    interleaved,
    median_ratio,
    natural_photos,
    pin_malloc,
)
from .loadgen import classify_requests, load


def server_throughput(store: Path, names: list[str], seconds: float, clients: int) -> float:
    """Images/s of ``memvit serve`` on ``store`` with ``clients`` clients, each request one random task."""
    from tests.server.launcher import ServerProcess

    server = ServerProcess(
        DEIT_TINY,
        store,
        stderr=subprocess.DEVNULL,
        MEMVIT_LOG_LEVEL="warning",
        MEMVIT_STORE_POLL_SECONDS="60",
    ).start(timeout=300)
    try:
        photos = [path.read_bytes() for path in natural_photos()]
        rng = random.Random(len(names))
        requests = [
            request.replace(
                b"/classify?top_k=1 ", f"/classify?top_k=1&tasks={rng.choice(names)} ".encode(), 1
            )
            for request in classify_requests("127.0.0.1", server.port, photos * 8)
        ]
        result = asyncio.run(load("127.0.0.1", server.port, requests, clients, seconds))
        if set(result.statuses) != {200}:
            raise RuntimeError(f"non-200 answers: {result.statuses}")
        return result.throughput
    finally:
        server.stop()


def server_share(rounds: int, seconds: float, clients: int, many: int) -> None:
    from memvit.adapters import bundle_for
    from memvit.server.store import LocalStore

    engine = deit_tiny_engine()
    with tempfile.TemporaryDirectory(prefix="memvit-routing-") as tmp:
        stores = {1: Path(tmp) / "one", many: Path(tmp) / "many"}
        for count, path in stores.items():
            store = LocalStore(path)
            for i in range(count):
                weights = random_adapter(f"t{i:04d}", engine, m=1, classes=100)
                store.write(weights.name, bundle_for(weights, engine).to_bytes(), replace=False)
        figures: dict[int, list[float]] = {1: [], many: []}
        for r in range(rounds):
            for count in (1, many) if r % 2 == 0 else (many, 1):
                names = [f"t{i:04d}" for i in range(count)]
                figures[count].append(server_throughput(stores[count], names, seconds, clients))
                print(f"  round {r + 1}: {count:,} loaded: {figures[count][-1]:.1f} images/s", flush=True)
        shares = [m / o for m, o in zip(figures[many], figures[1], strict=True)]
        print(
            f"| {clients} clients, one random task each "
            f"| 1 loaded: {statistics.median(figures[1]):.1f} images/s "
            f"| {many:,} loaded: {statistics.median(figures[many]):.1f} images/s "
            f"| share (median of rounds): {statistics.median(shares):.3f} |"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--archs", nargs="+", default=["vit_base_patch32_224", "deit_tiny_patch16_224"])
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 64, 1000])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--memory", type=int, default=1)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--all-up-to", type=int, default=64, help="largest K to time the all-tasks pass at")
    parser.add_argument("--server", action="store_true", help="measure through memvit serve instead")
    parser.add_argument("--seconds", type=float, default=15.0, help="--server: per load phase")
    parser.add_argument("--clients", type=int, default=32)
    args = parser.parse_args(argv)
    if args.server:
        print(environment(pin_malloc(), f"memvit serve, DeiT-Tiny, m=1, 100 classes, {args.clients} clients"))
        server_share(max(2, args.rounds // 3), args.seconds, args.clients, max(args.counts))
        return
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
            live = LiveAdapters(engine)  # installed, as a server holds them: each in its device slot
            live.replace_all(
                random_adapter(f"a{i}", engine, m=args.memory, classes=args.classes) for i in range(count)
            )
            loaded = live.current
            names = list(loaded.names)
            rng = random.Random(count)
            one = [[rng.choice(names)] for _ in range(args.batch)]
            eight = [rng.sample(names, min(8, count)) for _ in range(args.batch)]
            fns = {
                "base": lambda plain=plain, x=x: plain(x),
                "1": lambda engine=engine, x=x, s=loaded, one=one: engine(x, s, tasks=one),
                "8": lambda engine=engine, x=x, s=loaded, eight=eight: engine(x, s, tasks=eight),
            }
            if count <= args.all_up_to:
                fns["all"] = lambda engine=engine, x=x, s=loaded: engine(x, s)
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
