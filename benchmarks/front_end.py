"""One process against several API processes (server/frontend/), in alternating paired rounds.

    python -m benchmarks.front_end --arch vit_base_patch32_224 --seconds 20 --rounds 4   # ~8 min
    python -m benchmarks.front_end --configs 1 2/model-process                         # just these

Every configuration is a ``memvit serve`` (tests/server/launcher.py) of the same weights and the
same 8 adapters, all started at once (an idle server costs a store poll every 2 s). They are loaded
one at a time by ``--clients`` closed-loop clients posting the shared photos (benchmarks/loadgen.py,
the raw-socket load generator), each round loading every configuration once, in an order that
alternates from one round to the next (forwards, then backwards), because this machine's speed
drifts by 10-20% over minutes: a configuration is only ever compared with the others of its own
round. Reported: each round's images/s, p50 and p99, the mean images per fused pass (from the
merged ``/metrics``, where the processes not scraped are up to a second behind) and the server's
CPU per image (its processes together); then, per configuration, the median over the rounds of
its throughput over the first configuration's (1: one process) in the same round.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
from pathlib import Path

from benchmarks.common import (
    DEIT_TINY,
    argument_parser,
    deit_tiny_engine,
    environment,
    natural_photos,
    pin_malloc,
)
from benchmarks.loadgen import LoadResult, classify_requests, load
from benchmarks.serve_measures import adapter, batches, process_cpu
from memvit.adapters import bundle_for
from memvit.memory_core import MemoryViT, save_base
from tests.server.launcher import ServerProcess


def start(
    config: str, weights: Path, root: Path, bundles: dict[str, bytes], max_wait_ms: float
) -> ServerProcess:
    """``config``: "1" (one process) or "N/mode" (N API processes of the front end ``mode``)."""
    processes, _, mode = config.partition("/")
    store = root / f"store-{config.replace('/', '-')}"
    store.mkdir()
    for name, data in bundles.items():
        (store / f"{name}.safetensors").write_bytes(data)
    return ServerProcess(
        weights,
        store,
        stderr=None,
        MEMVIT_LOG_LEVEL="warning",
        MEMVIT_ADMIN_TOKEN="",
        MEMVIT_MAX_WAIT_MS=str(max_wait_ms),
        MEMVIT_STORE_POLL_SECONDS="2",
        MEMVIT_API_PROCESSES=processes,
        MEMVIT_FRONT_END=mode or "model-process",
    ).start(timeout=300)


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--arch", default="vit_base_patch32_224", help="timm architecture (random init)")
    parser.add_argument("--configs", nargs="+", default=["1", "2/model-process", "2/replicas"])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=20.0, help="per load phase")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-wait-ms", type=float, default=10.0)
    args = parser.parse_args(argv)
    malloc = pin_malloc()
    images = [p.read_bytes() for p in natural_photos()]
    real = args.arch == "deit_tiny_patch16_224" and DEIT_TINY.is_file()
    engine = deit_tiny_engine() if real else MemoryViT.from_timm(args.arch)
    bundles = {f"task-{i}": bundle_for(adapter(f"task-{i}", engine), engine).to_bytes() for i in range(8)}
    print(environment(f"{engine.spec.arch} ({engine.source})", "8 adapters", f"{len(images)} photos", malloc))
    print(f"{args.clients} clients, {args.seconds:g} s per phase, {args.rounds} rounds\n")

    results: dict[str, list[tuple[LoadResult, float | None]]] = {c: [] for c in args.configs}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        weights = DEIT_TINY if real else root / "base.safetensors"
        if not real:
            save_base(engine.base, weights, arch=args.arch)
        del engine
        servers = {c: start(c, weights, root, bundles, args.max_wait_ms) for c in args.configs}
        try:
            requests = {c: classify_requests("127.0.0.1", s.port, images) for c, s in servers.items()}
            for c, s in servers.items():  # warm-up: the first passes, the allocator, the connections
                asyncio.run(load("127.0.0.1", s.port, requests[c], args.clients, min(args.seconds, 6.0)))
            for r in range(args.rounds):
                order = args.configs if r % 2 == 0 else args.configs[::-1]
                for c in order:
                    server = servers[c]
                    cpu0, batched0 = process_cpu(server.pid), batches(server.url)
                    result = asyncio.run(
                        load("127.0.0.1", server.port, requests[c], args.clients, args.seconds)
                    )
                    cpu1, batched1 = process_cpu(server.pid), batches(server.url)
                    per_image = None if cpu0 is None or cpu1 is None else (cpu1 - cpu0) / result.completed
                    mean_batch = (batched1[0] - batched0[0]) / max(batched1[1] - batched0[1], 1)
                    results[c].append((result, per_image))
                    figures = f"p50 {result.p50_ms:.0f}, p99 {result.p99_ms:.0f} ms, batch {mean_batch:.1f}"
                    print(f"round {r + 1} {c}: {result.throughput:.1f} images/s, {figures}", flush=True)
        finally:
            for server in servers.values():
                server.stop()

    first = args.configs[0]
    print(
        "\n| round | " + " | ".join(f"{c}: images/s, p50, p99 ms, CPU ms/image" for c in args.configs) + " |"
    )
    print("|--:|" + "---|" * len(args.configs))
    for r in range(args.rounds):
        cells = []
        for c in args.configs:
            res, cpu = results[c][r]
            cpu_text = "-" if cpu is None else f"{1e3 * cpu:.0f}"
            cells.append(f"{res.throughput:.1f}, {res.p50_ms:.0f}, {res.p99_ms:.0f}, {cpu_text}")
        print(f"| {r + 1} | " + " | ".join(cells) + " |")
    print()
    for c in args.configs:
        ratios = [a[0].throughput / b[0].throughput for a, b in zip(results[c], results[first], strict=True)]
        errors = sum(n for res, _ in results[c] for status, n in res.statuses.items() if status >= 500)
        print(
            f"{c}: median {statistics.median(r[0].throughput for r in results[c]):.1f} images/s; "
            f"against {first} in the same round: median {statistics.median(ratios):.3f} "
            f"(rounds: {', '.join(f'{x:.3f}' for x in ratios)}); 5xx: {errors}"
        )


if __name__ == "__main__":
    main()
