"""Registry at scale: start-up and poll cost with 10 to 10,000 adapters in the store, on both backends.

For each store size N (bundles of m memory tokens and C classes for the real DeiT-Tiny):

1. Server: ``memvit serve`` as a child process, from launch to ``/readyz`` 200, against the store
   holding N bundles, and against an empty store (the process and the base model alone).
2. In process: the adapter registry's start-up (the store's index and the journal after it), a poll
   with nothing changed (and how many bundles it read: must be 0), and a poll after one adapter was
   replaced (must read no bundle either: the replaced adapter, if resident, is evicted and read again
   when next asked for). benchmarks/registry_scale.py measures 100,000 adapters and loads on demand.

The S3 backend runs against moto's S3-compatible server on a loopback port (tests/server/s3.py),
started by this script. Prints a Markdown table for benchmarks/RESULTS.md.

    python -m benchmarks.store_scale                       # 10, 100, 1000 on local and s3
    python -m benchmarks.store_scale --counts 10000 --backends local
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from memvit.adapters import bundle_for
from memvit.memory_core import LiveAdapters, MemoryViT
from memvit.server.registry import AdapterRegistry
from memvit.server.store import AdapterStore, open_store
from tests.factories import random_adapter
from tests.server.counting import bundle_reads, counting_requests
from tests.server.filling import register_in_bulk
from tests.server.launcher import ServerProcess

from .common import DEIT_TINY, argument_parser, environment, pin_malloc, timed


def fill(store: AdapterStore, engine: MemoryViT, count: int, *, m: int, classes: int) -> None:
    made = (
        bundle_for(random_adapter(f"a{i:05d}", engine, m=m, classes=classes), engine) for i in range(count)
    )
    register_in_bulk(store, ((b, b.to_bytes()) for b in made), as_index=True)


@contextlib.contextmanager
def backend(kind: str, workdir: Path) -> Iterator[callable]:
    """Yields a function giving a new, empty store location for ``kind``."""
    if kind == "local":
        counter = iter(range(10**6))
        yield lambda: str(workdir / f"store{next(counter)}")
        return
    from tests.server.s3 import new_bucket, s3_server

    with s3_server() as env:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # the store here and the servers started below read them
        try:
            yield lambda: f"s3://{new_bucket(env)}/adapters"
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def server_ready_seconds(location: str) -> float:
    server = ServerProcess(
        DEIT_TINY,
        location,
        stderr=subprocess.DEVNULL,
        MEMVIT_STORE_POLL_SECONDS="60",
        MEMVIT_LOG_LEVEL="warning",
    )
    start = time.perf_counter()
    server.start(timeout=300)
    seconds = time.perf_counter() - start
    server.stop()
    return seconds


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--counts", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--backends", nargs="+", default=["local", "s3"], choices=["local", "s3"])
    parser.add_argument("--memory", type=int, default=5, help="memory tokens per layer")
    parser.add_argument("--classes", type=int, default=100)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    print(environment(pin_malloc(), f"DeiT-Tiny, m={args.memory}, {args.classes} classes"))
    engine = MemoryViT.from_timm(weights=str(DEIT_TINY))
    workdir = Path(tempfile.mkdtemp(prefix="memvit-store-scale-"))
    rows = []
    try:
        for kind in args.backends:
            with backend(kind, workdir) as new_location:
                empty = server_ready_seconds(new_location())
                for count in args.counts:
                    location = new_location()
                    store = open_store(location)
                    fill_s = timed(lambda: fill(store, engine, count, m=args.memory, classes=args.classes))  # noqa: B023
                    ready = server_ready_seconds(location)
                    registry_store = open_store(location)
                    requests = counting_requests(registry_store)
                    service = AdapterRegistry(
                        LiveAdapters(MemoryViT.from_timm(weights=str(DEIT_TINY))),
                        registry_store,
                        max_bundle_bytes=1 << 26,
                    )
                    first = timed(service.open)
                    assert len(service) == count, service.invalid
                    read = len(bundle_reads(requests))
                    idle = timed(service.sync)
                    idle_reads = len(bundle_reads(requests)) - read
                    writer = AdapterRegistry(
                        LiveAdapters(engine), open_store(location), max_bundle_bytes=1 << 26
                    )
                    writer.open()
                    weights = random_adapter("a00000", engine, m=args.memory, classes=args.classes, seed=1)
                    writer.register(bundle_for(weights, engine).to_bytes(), replace=True)
                    one = timed(service.sync)
                    one_reads = len(bundle_reads(requests)) - read - idle_reads
                    rows.append((kind, count, fill_s, empty, ready, first, idle, idle_reads, one, one_reads))
                    print(f"  {kind} N={count}: ready {ready:.2f} s (empty store {empty:.2f} s)", flush=True)
                    if kind == "local":
                        shutil.rmtree(location, ignore_errors=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print()
    columns = ["backend", "adapters", "server ready (s)", "... empty store (s)", "registry open (s)"]
    columns += ["per adapter (ms)", "idle poll (ms)", "bundles read", "poll after 1 replace (ms)"]
    columns += ["bundles read"]
    print("| " + " | ".join(columns) + " |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for kind, count, _fill, empty, ready, first, idle, idle_reads, one, one_reads in rows:
        print(
            f"| {kind} | {count:,} | {ready:.2f} | {empty:.2f} | {first:.2f} | {first / count * 1000:.2f} "
            f"| {idle * 1000:.1f} | {idle_reads} | {one * 1000:.1f} | {one_reads} |"
        )


if __name__ == "__main__":
    main()
