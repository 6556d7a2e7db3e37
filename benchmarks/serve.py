"""The HTTP service under load, against the raw fused model, in one run.

    python -m benchmarks.serve                                            # DeiT-Tiny (real weights), ~5 min
    python -m benchmarks.serve --arch vit_base_patch32_224 --seconds 30   # ViT-B/32, ~9 min
    python -m benchmarks.serve --arch vit_base_patch16_224 --seconds 90   # the paper's ViT-B/16, ~25 min
    python -m benchmarks.serve --inputs model-size                        # 224x224 JPEG uploads
    python -m benchmarks.serve --decode fast                              # MEMVIT_DECODE=fast
    python -m benchmarks.serve --api-processes 2                          # MEMVIT_API_PROCESSES=2
    python -m benchmarks.front_end --arch vit_base_patch32_224            # 1 against 2, paired rounds

1. Raw: the fused model in this process (8 adapters loaded) on preprocessed images at batch sizes
   1..64, each measured twice (the sizes in one order, then in reverse) and averaged; the best
   batch size is the one the server is measured against.
2. Server: ``memvit serve`` (a separate process started by tests/server/launcher.py, the same
   weights and the same 8 adapters in its store); 1 and 8 closed-loop clients each post real photos
   (the shared data's photos/natural/, one per request; ``--inputs model-size``: the same photos
   already at the model's input size, 224x224 JPEGs as a client that resizes before uploading sends)
   for a fixed time: throughput, p50 and p99 latency.
3. Rounds at 32 clients. This machine's speed drifts by 10-20% over minutes (shared host), so the
   server is never compared with a raw figure taken minutes earlier: each round measures raw at the
   best batch size, then 32 clients, then 32 clients while another client registers and deletes a
   9th adapter in a loop, then raw again. The share is the server's throughput over the mean of the
   round's two raw figures; the p99 rise compares the round's two 32-client phases. Medians of the
   rounds are the result. Each round also reads the server's own /metrics: the mean images per
   fused pass it formed, and raw at that batch size (the sweep's figure for it, scaled to the
   round's raw), since 32 closed-loop clients split into groups that take turns on the model and
   never form raw's best batch.
4. Where the CPU goes (Linux): the server's CPU per image (model, decoding, HTTP), the raw model's,
   the decoder's, the load generator's. The decoder shares the cores with the model, which bounds
   the server's throughput from above: 1 / (1/raw + decode CPU s per image / cores).
Targets: photos, server >= 0.92 x that bound; model-size uploads, server >= 0.90 x raw; the p99
with registrations running within 1.2x of without; no 5xx.
DeiT-Tiny uses the real ImageNet weights when the shared data (../shared/data or $MEMVIT_SHARED_DATA)
has them; other architectures are random-init (the cost does not depend on the weights) and handed to
the server as a file. The adapters are random (tests/factories.py).
"""

from __future__ import annotations

import asyncio
import io
import statistics
import tempfile
from pathlib import Path

import torch
from PIL import Image

from benchmarks.common import (
    DEIT_TINY,
    argument_parser,
    deit_tiny_engine,
    environment,
    natural_photos,
    pin_malloc,
)
from benchmarks.loadgen import classify_requests, load
from benchmarks.serve_measures import (
    BATCHES,
    adapter,
    at_batch,
    batches,
    decode_rate,
    model_size_jpeg,
    process_cpu,
    raw_rate,
    row,
)
from memvit.adapters import bundle_for, save_bundle
from memvit.adapters.preprocess import eval_transform, to_rgb
from memvit.memory_core import MemoryViT, save_base
from memvit.server.settings import Settings
from tests.server.launcher import ServerProcess


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--seconds", type=float, default=15.0, help="per load phase")
    parser.add_argument("--rounds", type=int, default=3, help="32-client rounds, each bracketed by raw")
    parser.add_argument("--raw-seconds", type=float, default=4.0, help="per raw measurement")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--max-wait-ms", type=float, default=10.0)
    parser.add_argument("--inputs", choices=["photos", "model-size"], default="photos")
    parser.add_argument("--decode", choices=["exact", "fast"], default="exact", help="MEMVIT_DECODE")
    parser.add_argument("--api-processes", type=int, default=1, help="MEMVIT_API_PROCESSES")
    parser.add_argument(
        "--front-end", choices=["model-process", "replicas"], default="model-process", help="MEMVIT_FRONT_END"
    )
    parser.add_argument(
        "--arch",
        default="deit_tiny_patch16_224",
        help="timm architecture; DeiT-Tiny uses the real weights when present, others random init",
    )
    args = parser.parse_args(argv)
    malloc = pin_malloc()  # as `memvit serve` does
    images = [p.read_bytes() for p in natural_photos()]
    real_weights = args.arch == "deit_tiny_patch16_224" and DEIT_TINY.is_file()
    engine = deit_tiny_engine() if real_weights else MemoryViT.from_timm(args.arch)
    adapters = [adapter(f"task-{i}", engine) for i in range(8)]
    served = engine.prepare_set(adapters)  # what the server's store will hold
    cores = torch.get_num_threads()

    if args.inputs == "model-size":
        images = [model_size_jpeg(engine, d) for d in images]
    transform = eval_transform(engine)
    pixels = torch.stack([transform(to_rgb(Image.open(io.BytesIO(d)))) for d in images])
    batch_of = {b: pixels[torch.arange(b) % len(pixels)] for b in BATCHES}
    # Two passes over the batch sizes, the second in reverse order, so that a slow minute of the host
    # does not crown one batch size; each size's figure is the mean of its two.
    passes = [{b: raw_rate(engine, served, batch_of[b], args.raw_seconds)[0] for b in order}
              for order in (BATCHES, BATCHES[::-1])]  # fmt: skip
    sweep = {b: statistics.fmean(p[b] for p in passes) for b in BATCHES}
    best_batch = max(sweep, key=sweep.get)
    print(
        environment(
            f"{engine.spec.arch} ({engine.source})",
            "8 adapters (m=1, 100 classes)",
            f"{len(images)} photos ({args.inputs}, decode {args.decode})",
            f"{args.api_processes} API processes, {args.front_end}" if args.api_processes > 1 else "1 proc",
            malloc,
        )
        + "\n"
    )
    print("| raw fused pass, batch | " + " | ".join(str(b) for b in BATCHES) + " |")
    print("|---|" + "--:|" * len(BATCHES))
    print("| images/s | " + " | ".join(f"{sweep[b]:.1f}" for b in BATCHES) + " |\n")
    decode, decode_cpu = decode_rate(engine, images, seconds=4.0, workers=cores, mode=args.decode)

    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        store.mkdir()
        for w in adapters:
            save_bundle(bundle_for(w, engine), store / f"{w.name}.safetensors")
        hot_bundle = bundle_for(adapter("hot", engine), engine).to_bytes()
        if real_weights:
            weights = DEIT_TINY
        else:  # random init: hand the server these very weights, so both measure the same model
            weights = Path(tmp) / "base.safetensors"
            save_base(engine.base, weights, arch=args.arch)
        server = ServerProcess(
            weights,
            store,
            stderr=None,  # the server's warnings go to this terminal
            MEMVIT_MAX_BATCH=str(args.max_batch),
            MEMVIT_MAX_WAIT_MS=str(args.max_wait_ms),
            MEMVIT_LOG_LEVEL="warning",
            MEMVIT_ADMIN_TOKEN="",
            MEMVIT_DECODE=args.decode,
            MEMVIT_API_PROCESSES=str(args.api_processes),
            MEMVIT_FRONT_END=args.front_end,
            # the service's own store poll, not the launcher's quick one for tests
            MEMVIT_STORE_POLL_SECONDS=str(Settings.model_fields["store_poll_seconds"].default),
        ).start(timeout=120)
        port = server.port
        requests = classify_requests("127.0.0.1", port, images)
        try:
            asyncio.run(load("127.0.0.1", port, requests, 8, min(args.seconds, 5.0)))  # warm-up
            low = [asyncio.run(load("127.0.0.1", port, requests, c, args.seconds)) for c in (1, 8)]
            rounds = []
            for _ in range(args.rounds):
                before = raw_rate(engine, served, batch_of[best_batch], args.raw_seconds)
                cpu0, batched0 = process_cpu(server.pid), batches(server.url)
                plain = asyncio.run(load("127.0.0.1", port, requests, 32, args.seconds))
                cpu1, batched1 = process_cpu(server.pid), batches(server.url)
                mean_batch = (batched1[0] - batched0[0]) / max(batched1[1] - batched0[1], 1)
                hot_row = asyncio.run(
                    load("127.0.0.1", port, requests, 32, args.seconds, hot_bundle=hot_bundle)
                )
                after = raw_rate(engine, served, batch_of[best_batch], args.raw_seconds)
                server_cpu = None if cpu0 is None else (cpu1 - cpu0) / plain.completed
                rounds.append((before, plain, hot_row, after, server_cpu, mean_batch))
        finally:
            server.stop()

    print("| clients | requests in window | images/s | p50 ms | p99 ms | statuses (all requests) |")
    print("|--:|--:|--:|--:|--:|---|")
    for r in low:
        print(row(str(r.clients), r))
    for i, (_, plain, hot_row, _, _, _) in enumerate(rounds, 1):
        print(row(f"32 (round {i})", plain))
        print(row(f"32 + hot registration (round {i}: {hot_row.admin})", hot_row))

    print(
        "\n| round | raw before | server, 32 clients | raw after | share | server's mean batch "
        "| share of raw at that batch | p99 | p99 hot | p99 rise |"
    )
    print("|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    shares, at_batch_shares, at_batch_bounds, rises = [], [], [], []
    for i, (before, plain, hot_row, after, _, mean_batch) in enumerate(rounds, 1):
        raw = (before[0] + after[0]) / 2
        shares.append(plain.throughput / raw)
        raw_there = raw * at_batch(sweep, mean_batch) / sweep[best_batch]
        at_batch_shares.append(plain.throughput / raw_there)
        at_batch_bounds.append(at_batch_shares[-1] * (1 + raw_there * decode_cpu / cores))
        rises.append(hot_row.p99_ms / plain.p99_ms - 1)
        print(
            f"| {i} | {before[0]:.1f} | {plain.throughput:.1f} | {after[0]:.1f} | {shares[-1]:.1%} "
            f"| {mean_batch:.1f} | {at_batch_shares[-1]:.1%} "
            f"| {plain.p99_ms:.0f} | {hot_row.p99_ms:.0f} | {rises[-1]:+.1%} |"
        )
    share, rise = statistics.median(shares), statistics.median(rises)
    every_load = [*low, *(r for _, plain, hot_row, *_ in rounds for r in (plain, hot_row))]
    errors = sum(n for r in every_load for status, n in r.statuses.items() if status >= 500)

    raw_cpu = statistics.mean(cpu for rd in rounds for cpu in (rd[0][1], rd[3][1]))
    raw_rate_mean = statistics.mean(x for rd in rounds for x in (rd[0][0], rd[3][0]))
    ceiling = 1 / (1 + raw_rate_mean * decode_cpu / cores)  # the bound over raw
    against = ceiling if args.inputs == "photos" else 1.0
    target = 0.92 if args.inputs == "photos" else 0.90
    server_cpus = [rd[4] for rd in rounds if rd[4] is not None]
    print(
        f"\nCPU per image: raw fused pass {1e3 * raw_cpu:.1f} ms (batch {best_batch}); decoding and "
        f"preprocessing these photos {1e3 * decode_cpu:.1f} ms ({decode:.0f} images/s on {cores} threads); "
        + (f"the server, all in, {1e3 * statistics.mean(server_cpus):.1f} ms; " if server_cpus else "")
        + f"the load generator {statistics.mean(rd[1].client_cpu_ms for rd in rounds):.2f} ms per request."
    )
    print(
        f"With decoding on the same {cores} cores the server cannot exceed "
        f"1 / (1 + raw x decode CPU / cores) = {ceiling:.1%} of raw before any HTTP work."
    )
    bound = "the decode bound" if args.inputs == "photos" else "raw"
    print(
        f"\nserver throughput at 32 clients / raw at batch {best_batch} (median of {len(rounds)} rounds): "
        f"{share:.1%}; against {bound}: {share / against:.1%} "
        f"({'ok' if share / against >= target else 'MISS'}, target >= {target:.0%})"
    )
    print(
        f"against raw at the batch the server formed (median): {statistics.median(at_batch_shares):.1%}"
        + (f"; against the decode bound at that batch: {statistics.median(at_batch_bounds):.1%}"
           if args.inputs == "photos" else "")
    )  # fmt: skip
    print(f"p99 with registrations running: {rise:+.1%} ({'ok' if rise <= 0.20 else 'MISS'}, target <= +20%)")
    print(f"5xx responses: {errors} ({'ok' if errors == 0 else 'MISS'}, target 0)")


if __name__ == "__main__":
    main()
