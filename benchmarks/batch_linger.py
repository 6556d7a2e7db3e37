"""Latency and CPU of a group with and without the batch linger (server/inference/arrivals.py).

    python -m benchmarks.batch_linger                  # 2 API processes + model, ~3 min
    python -m benchmarks.batch_linger --configs 1      # one process

Two servers of benchmarks/front_end_cpu.py's set-up (the pass stubbed, a 95 KiB JPEG decoding to
32x32, 8 adapters, device decoding), one with ``MEMVIT_BATCH_LINGER=0`` (the default) and one with
each other value asked; closed-loop clients at each count; p50 and p99 latency, requests per second
and the CPU of every process of the server per request, medians of alternating rounds. A closed
loop of one or a few clients is where the linger costs: their next request cannot come while their
batch waits for it.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
from pathlib import Path

from benchmarks.common import argument_parser
from benchmarks.front_end_cpu import BASE, padded_jpeg, start
from benchmarks.loadgen import classify_requests, load
from benchmarks.processes import RoleClock
from benchmarks.stub_pass import site_dir
from memvit.adapters import bundle_for
from memvit.memory_core import MemoryViT, save_base
from tests.factories import random_adapter


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--configs", default="2", help='"1" or "N" API processes')
    parser.add_argument("--lingers", nargs="+", default=["0", "2"])
    parser.add_argument("--clients", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    engine = MemoryViT.from_timm("vit_tiny_patch16_224", **BASE)
    bundles = {
        f"task-{i}": bundle_for(random_adapter(f"task-{i}", engine, m=1, classes=10), engine).to_bytes()
        for i in range(8)
    }
    results: dict[tuple[int, str], list[tuple[float, ...]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        weights = root / "base.safetensors"
        save_base(engine.base, weights, arch="vit_tiny_patch16_224", model_kwargs=BASE)
        servers = {}
        try:
            for linger in args.lingers:
                os.environ["MEMVIT_BATCH_LINGER"] = linger  # the server inherits it
                where = root / f"linger-{linger}"
                where.mkdir()
                servers[linger] = start(
                    f"{args.configs} device", weights, where, bundles, None, None, site_dir(where), wait=False
                )
            os.environ.pop("MEMVIT_BATCH_LINGER")
            for server in servers.values():  # they load at once (each took its environment at start)
                server.wait_ready(300)
            requests = {
                n: classify_requests("127.0.0.1", s.port, [padded_jpeg()]) for n, s in servers.items()
            }
            for n, s in servers.items():  # warm-up, no longer than a phase (as front_end_cpu's)
                asyncio.run(load("127.0.0.1", s.port, requests[n], 16, min(args.seconds, 3.0)))
            for r in range(args.rounds):
                for clients in args.clients:
                    for n in args.lingers if r % 2 == 0 else args.lingers[::-1]:
                        clock = RoleClock(servers[n].pid)
                        got = asyncio.run(
                            load("127.0.0.1", servers[n].port, requests[n], clients, args.seconds)
                        )
                        cpu = 1e3 * sum(clock.seconds().values()) / got.completed
                        row = (got.p50_ms, got.p99_ms, got.throughput, cpu)
                        results.setdefault((clients, n), []).append(row)
                        said = "p50 {:.2f} ms, p99 {:.2f} ms, {:.0f} req/s, group {:.3f} ms/req".format(*row)
                        print(f"round {r + 1}, {clients} clients, linger {n}: {said}", flush=True)
        finally:
            for server in servers.values():
                server.stop()
    print("\n| clients | MEMVIT_BATCH_LINGER | p50 ms | p99 ms | req/s | group CPU ms/req |")
    print("|--:|--:|--:|--:|--:|--:|")
    for (clients, n), rows in sorted(results.items()):
        p50, p99, rate, cpu = (statistics.median(row[i] for row in rows) for i in range(4))
        print(f"| {clients} | {n} | {p50:.2f} | {p99:.1f} | {rate:.0f} | {cpu:.3f} |")


if __name__ == "__main__":
    main()
