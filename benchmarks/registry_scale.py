"""Adapters at scale: a registry of 100,000 adapters, a few thousand resident, loaded on demand.

DeiT-Tiny-shaped adapters (the real DeiT-Tiny base: 12 layers, width 192), m memory tokens and C
classes each (m = 1, C = 10 by default: 18 kB bundles). Prints the figures of RESULTS §3.8:

1. Start-up: ``memvit serve`` from launch to ``/readyz`` 200 on a store of N adapters against an
   empty store (alternating, medians): N = 100,000 on a local directory, 10,000 on the S3 test server
   (moto on loopback, tests/server/s3.py).
2. An idle poll: store requests and milliseconds (in process).
3. A cold load (an adapter not resident, asked for): its added latency, p50 and p99, on both.
4. Memory: RSS per registered adapter (the catalog) and per resident adapter, against its tensors.
5. Zipf(s) traffic over the N adapters with 5% resident: the hit rate against the ideal static set's
   (the 5% most popular, known in advance), and throughput (one image per request, 8 requests per
   routed pass) against every adapter resident, on the same requests. All resident is compared on a
   smaller universe with the same Zipf shape (``--universe``): preparing 100,000 adapters takes GBs.

The local store is filled fast: bundle objects written as plain files (no fsync: this is test data),
then the journal's base and index in one write each, as a migration of that many bundles would.

    python -m benchmarks.registry_scale
    python -m benchmarks.registry_scale --count 10000 --s3-count 1000 --trace 2000   # quicker
"""

from __future__ import annotations

import logging
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.registry_fill import bundles, fill_local, zipf_trace
from memvit.adapters import read_bundle
from memvit.memory_core import LiveAdapters, MemoryViT
from memvit.server.registry import AdapterRegistry
from memvit.server.store import LocalStore, open_store
from tests.server.counting import counting_requests
from tests.server.filling import register_in_bulk
from tests.server.launcher import ServerProcess

from .adapter_churn import rss_bytes
from .common import DEIT_TINY, argument_parser, environment, pin_malloc, timed
from .store_scale import backend

BATCH = 8


def ready_ratio(full: str, empty: str, rounds: int) -> tuple[float, float]:
    """Median seconds to /readyz 200 on ``full`` and on ``empty``, alternating."""

    def ready(location: str) -> float:
        server = ServerProcess(
            DEIT_TINY, location, stderr=subprocess.DEVNULL, MEMVIT_STORE_POLL_SECONDS="60",
            MEMVIT_LOG_LEVEL="warning",
        )  # fmt: skip
        seconds = timed(lambda: server.start(timeout=600))
        server.stop()
        return seconds

    times: dict[str, list[float]] = {"full": [], "empty": []}
    for _ in range(rounds):
        times["empty"].append(ready(empty))
        times["full"].append(ready(full))
    return statistics.median(times["full"]), statistics.median(times["empty"])


def registry_on(location: str, engine: MemoryViT, resident: int) -> AdapterRegistry:
    registry = AdapterRegistry(
        LiveAdapters(engine), open_store(location), max_bundle_bytes=1 << 24, resident_adapters=resident
    )
    registry.open()
    return registry


def idle_polls(registry: AdapterRegistry, polls: int = 20) -> tuple[float, float]:
    """Store requests per idle poll, and its median milliseconds."""
    requests = counting_requests(registry.store)
    times = [timed(registry.sync) for _ in range(polls)]
    return len(requests) / polls, 1000 * statistics.median(times)


def cold_loads(registry: AdapterRegistry, names: list[str]) -> tuple[float, float, float]:
    """p50 and p99 milliseconds of asking for an adapter not resident, less a resident one's p50."""
    cold = [timed(lambda n=name: registry.acquire([n]).release()) for name in names]
    warm = [timed(lambda n=name: registry.acquire([n]).release()) for name in names[-20:]]
    base = statistics.median(warm)
    p50, p99 = np.percentile(cold, [50, 99])
    return 1000 * (p50 - base), 1000 * (p99 - base), 1000 * base


def serve_both(
    registry: AdapterRegistry, everything: LiveAdapters, names: list[str], x: torch.Tensor
) -> dict[str, list[float]]:
    """Answer ``names`` (one image each, BATCH per routed pass) twice, batch by batch: loading on
    demand through ``registry``, and with ``everything`` resident. Alternating batch by batch, so a
    busy moment of a shared machine hits both alike. Wall and CPU seconds (this process, all threads)
    of each, per batch."""
    engine = everything.engine
    times: dict[str, list[float]] = {"lazy": [], "all": [], "lazy cpu": [], "all cpu": []}
    for i in range(0, len(names), BATCH):
        batch = names[i : i + BATCH]
        tasks = [[n] for n in batch]
        for kind in ("lazy", "all"):
            wall, cpu = time.perf_counter(), time.process_time()
            if kind == "lazy":
                with registry.acquire(batch), torch.inference_mode():
                    engine(x[: len(batch)], registry.live.current, tasks=tasks)
            else:
                with torch.inference_mode():
                    engine(x[: len(batch)], everything.current, tasks=tasks)
            times[kind].append(time.perf_counter() - wall)
            times[f"{kind} cpu"].append(time.process_time() - cpu)
    return times


def hit_rate(registry: AdapterRegistry, names: list[str]) -> float:
    hits = 0
    for name in names:
        hits += name in registry.resident
        registry.acquire([name]).release()
    return hits / len(names)


PARTS = ("ready", "memory", "zipf", "throughput", "s3")


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--count", type=int, default=100_000, help="adapters in the local store")
    parser.add_argument("--s3-count", type=int, default=10_000, help="adapters on the S3 test server")
    parser.add_argument("--memory", type=int, default=1, help="memory tokens per layer")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--resident", type=float, default=0.05, help="resident share of the registry")
    parser.add_argument("--zipf", type=float, default=1.1)
    # Steady state: with 5,000 resident, segmented LRU needs ~100,000 requests to settle (20,000 of
    # warm-up then 40,000 counted read 0.944 of the ideal; 100,000 and 100,000, 0.97).
    parser.add_argument("--warmup", type=int, default=100_000, help="requests before the hit rate counts")
    parser.add_argument("--hits", type=int, default=100_000, help="requests the hit rate counts")
    parser.add_argument("--trace", type=int, default=1_600, help="requests timed, for throughput")
    parser.add_argument("--universe", type=int, default=10_000, help="adapters for the all-resident case")
    parser.add_argument("--rounds", type=int, default=3, help="server starts per store")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    print(environment(pin_malloc(), f"DeiT-Tiny, m={args.memory}, {args.classes} classes"), flush=True)
    engine = MemoryViT.from_timm(weights=str(DEIT_TINY))
    workdir = Path(tempfile.mkdtemp(prefix="memvit-registry-scale-"))
    figures: dict[str, object] = {}
    try:
        local = str(workdir / "local")
        if set(args.parts) - {"s3"}:
            made = bundles(engine, args.count, args.memory, args.classes)
            fill_s = timed(lambda: fill_local(LocalStore(local), made))
            print(f"filled {args.count:,} adapters in {fill_s:.0f} s", flush=True)
        if "ready" in args.parts:
            figures["ready local"] = ready_ratio(local, str(workdir / "empty"), args.rounds)
        if {"memory", "zipf"} & set(args.parts):
            memory_and_zipf(figures, args, engine, local)
        if "throughput" in args.parts:
            throughput(figures, args, engine, local)
        shutil.rmtree(local, ignore_errors=True)
        if "s3" in args.parts:
            on_s3(figures, args, engine, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report(figures, args)


def memory_and_zipf(figures: dict, args, engine: MemoryViT, local: str) -> None:
    resident = int(args.resident * args.count)
    rss0 = rss_bytes()
    registry = registry_on(local, engine, resident)
    if "memory" in args.parts:
        # The catalog, then the resident set filled to its cap, against its tensors.
        figures["catalog bytes per adapter"] = (rss_bytes() - rss0) / args.count
        rss1 = rss_bytes()
        for i in random.Random(2).sample(range(args.count), resident):
            registry.acquire([f"a{i:06d}"]).release()
        per_resident = (rss_bytes() - rss1) / len(registry.resident)
        one = registry.resident.get(registry.live.current.names[0])
        assert one is not None
        w = one.bundle.weights
        tensors = sum(t.numel() * 4 for t in (w.memory, w.cls_token, w.head_weight, w.head_bias))
        held = registry.resident.nbytes
        figures["memory"] = (per_resident, tensors, one.nbytes, len(registry.resident), held)
        # Polls and cold loads with the resident set full (a cold load evicts, as in steady state).
        figures["idle local"] = idle_polls(registry)
        sample = random.Random(1).sample(range(args.count), 300)
        figures["cold local"] = cold_loads(registry, [f"a{i:06d}" for i in sample])
        print(f"memory {figures['memory']}, idle {figures['idle local']}, cold {figures['cold local']}")
    if "zipf" in args.parts:
        # Zipf over the whole registry, 5% resident: hit rate against the ideal static set.
        names, ranks = zipf_trace(args.count, args.warmup + args.hits, args.zipf, seed=3)
        trace = [names[r] for r in ranks]
        hit_rate(registry, trace[: args.warmup])
        loads = registry.resident.loads
        hits = hit_rate(registry, trace[args.warmup :])
        ideal = float(np.mean(np.array(ranks[args.warmup :]) < resident))
        figures["zipf"] = (hits, ideal, registry.resident.loads - loads)
        print(f"zipf hit {hits:.4f} ideal {ideal:.4f}", flush=True)
    registry.close()


def throughput(figures: dict, args, engine: MemoryViT, local: str) -> None:
    """On a smaller universe, same Zipf shape: 5% resident against all resident, same requests."""
    universe = min(args.universe, args.count)
    names, ranks = zipf_trace(universe, 2 * args.trace, args.zipf, seed=4)
    trace = [names[r] for r in ranks]
    small = registry_on(local, engine, int(args.resident * universe))
    hit_rate(small, trace[: args.trace])  # warm
    everything = LiveAdapters(engine)
    journal = small.catalog.journal
    weights = (read_bundle(journal.get_bundle(small.get(n))).weights for n in sorted(set(names)))
    everything.install(engine.prepare_set(weights))
    x = torch.randn(BATCH, 3, 224, 224)
    times = serve_both(small, everything, trace[args.trace :], x)
    n = len(trace) - args.trace
    cpu = sum(times["all cpu"]) / sum(times["lazy cpu"])
    figures["throughput"] = (n / sum(times["lazy"]), n / sum(times["all"]), universe, cpu)
    print(f"throughput {figures['throughput']}", flush=True)
    small.close()


def on_s3(figures: dict, args, engine: MemoryViT, workdir: Path) -> None:
    with backend("s3", workdir) as new_location:
        s3, s3_empty = new_location(), new_location()
        made = bundles(engine, args.s3_count, args.memory, args.classes)
        fill_s = timed(lambda: register_in_bulk(open_store(s3), made, as_index=True))
        print(f"filled {args.s3_count:,} on S3 in {fill_s:.0f} s", flush=True)
        figures["ready s3"] = ready_ratio(s3, s3_empty, args.rounds)
        registry = registry_on(s3, engine, 1024)
        figures["idle s3"] = idle_polls(registry)
        sample = random.Random(5).sample(range(args.s3_count), 100)
        figures["cold s3"] = cold_loads(registry, [f"a{i:06d}" for i in sample])
        registry.close()


def report(f: dict, args) -> None:
    share = f"{args.resident:.0%}"
    rows = []
    for where, count in (("local", args.count), ("s3", args.s3_count)):
        if f"ready {where}" in f:
            full, empty = f[f"ready {where}"]
            measured = f"{full:.2f} s / {empty:.2f} s = **{full / empty:.2f}x**"
            rows.append((f"ready, {count:,} adapters ({where}) / empty store", measured, "<= 1.5x"))
    for where in ("local", "s3"):
        if f"idle {where}" in f:
            requests, ms = f[f"idle {where}"]
            rows.append((f"idle poll, {where}", f"{requests:.0f} request(s), {ms:.2f} ms", "<= 2, <= 50 ms"))
    for where, target in (("local", 50), ("s3", 150)):
        if f"cold {where}" in f:
            p50, p99, warm = f[f"cold {where}"]
            measured = f"{p50:.1f} / **{p99:.1f} ms** (resident: {warm:.2f} ms)"
            rows.append((f"cold load, added latency, {where}: p50 / p99", measured, f"p99 <= {target} ms"))
    if "memory" in f:
        per_resident, tensors, accounted, resident, held = f["memory"]
        rows += [
            ("catalog: RSS per registered adapter", f"{f['catalog bytes per adapter']:,.0f} B", ""),
            ("RSS per resident adapter / its tensors",
             f"{per_resident / 1024:.1f} kB / {tensors / 1024:.1f} kB = {per_resident / tensors:.2f}x "
             f"(accounted {accounted / 1024:.1f} kB; {resident:,} resident, {held / 2**20:.0f} MiB)", ""),
            (f"all {args.count:,} resident would hold", f"{args.count * accounted / 2**30:.1f} GiB", ""),
        ]  # fmt: skip
    if "zipf" in f:
        hits, ideal, loads = f["zipf"]
        rows.append((
            f"Zipf({args.zipf}) over {args.count:,}, {share} resident: hit rate / ideal static",
            f"{hits:.3f} / {ideal:.3f} = **{hits / ideal:.3f}** ({loads:,} loads)", ">= 0.95",
        ))  # fmt: skip
    if "throughput" in f:
        lazy, everything, universe, cpu = f["throughput"]
        rows.append((
            f"throughput, {share} resident / all resident ({universe:,} adapters, same requests)",
            f"{lazy:.1f} / {everything:.1f} req/s = **{lazy / everything:.2f}** (CPU: {cpu:.2f})", ">= 0.8",
        ))  # fmt: skip
    print()
    print("| figure | measured | target |")
    print("|---|---:|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
