"""Full garbage collections in a loaded server: how long each holds its process, with the heap
frozen once loaded (``memory_core/runtime.py`` ``freeze_heap``, the default) and without.

    python -m benchmarks.gc_pauses                                  # 1 process and the group, ~4 min
    python -m benchmarks.gc_pauses --configs 2 --seconds 60

A full collection walks every object the collector tracks with the GIL held: every thread of the
process waits, the engine's included. Each server here is ``memvit serve`` on a one-block base
with 8 adapters, its pass stubbed (benchmarks/stub_pass.py: the host's work only, so requests come
fast and allocate as a GPU server's do), 16 closed-loop clients posting a 95 KiB JPEG. A
``sitecustomize`` on the path of every process of the server times each collection
(``gc.callbacks``) and writes those of the oldest generation (and any over 20 ms) to stderr with
the process's name; for "not frozen" it also makes ``gc.freeze`` a no-op, so the server's own call
does nothing. Collections count from ``--settle`` seconds after the first process is ready (every
process loaded) to the load's end.
"""

from __future__ import annotations

import asyncio
import re
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from benchmarks.common import argument_parser, environment
from benchmarks.front_end_cpu import BASE, padded_jpeg
from benchmarks.loadgen import classify_requests, load
from benchmarks.stub_pass import REPO
from memvit.adapters import bundle_for
from memvit.memory_core import MemoryViT, save_base
from tests.factories import random_adapter
from tests.server.launcher import ServerProcess

MARK = "GC-PAUSE"
WATCH = f"""
import gc, os, sys, time
_started = [0.0]
def _name():
    with open("/proc/self/comm") as f:
        return f.read().strip()
def _timed(phase, info):
    if phase == "start":
        _started[0] = time.perf_counter()
        return
    ms = 1e3 * (time.perf_counter() - _started[0])
    if info["generation"] == 2 or ms > 20:
        sys.stderr.write("{MARK} t=%.3f pid=%d name=%s gen=%d ms=%.1f\\n"
                         % (time.time(), os.getpid(), _name(), info["generation"], ms))
gc.callbacks.append(_timed)
"""
_LINE = re.compile(rf"{MARK} t=(\S+) pid=(\d+) name=(\S+) gen=(\d) ms=(\S+)")


def site_dir(root: Path, frozen: bool) -> Path:
    """A directory whose ``sitecustomize`` times the collections (and stubs the pass)."""
    where = root / f"watch-{'frozen' if frozen else 'not-frozen'}"
    where.mkdir(parents=True)
    stub = f"import sys\nsys.path.append({str(REPO)!r})\n"
    stub += "from benchmarks.stub_pass import install\ninstall()\n"
    unfreeze = "" if frozen else "gc.freeze = lambda: None  # the server's own call does nothing\n"
    (where / "sitecustomize.py").write_text(WATCH + unfreeze + stub)
    return where


def full_collections(log: str, since: float, until: float) -> dict[str, list[float]]:
    """``"<name> (<pid>)"`` -> the milliseconds of each full collection between ``since`` and ``until``."""
    out: dict[str, list[float]] = defaultdict(list)
    for t, pid, name, generation, ms in _LINE.findall(log):
        if generation == "2" and since <= float(t) <= until:
            out[f"{name} ({pid})"].append(float(ms))
    return dict(out)


def measure(config: str, frozen: bool, root: Path, weights: Path, store: Path, args) -> tuple[float, dict]:
    """One server's req/s under the load, and its processes' full collections during it."""
    root.mkdir(parents=True)
    log_path = root / "server.log"
    with log_path.open("wb") as log:
        server = ServerProcess(
            weights, store, stderr=log, MEMVIT_LOG_LEVEL="warning", MEMVIT_ADMIN_TOKEN="",
            MEMVIT_DECODE_DEVICE="device", MEMVIT_API_PROCESSES=config,
            PYTHONPATH=str(site_dir(root, frozen)),
        ).start(timeout=300)  # fmt: skip
        try:
            requests = classify_requests("127.0.0.1", server.port, [padded_jpeg()])
            time.sleep(args.settle)
            since = time.time()
            got = asyncio.run(load("127.0.0.1", server.port, requests, args.clients, args.seconds))
            until = time.time()
        finally:
            server.stop()
    return got.throughput, full_collections(log_path.read_text(errors="replace"), since, until)


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--configs", nargs="+", default=["1", "2"], help="MEMVIT_API_PROCESSES values")
    parser.add_argument("--seconds", type=float, default=30.0, help="load per server")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds for every process to load")
    parser.add_argument("--clients", type=int, default=16)
    args = parser.parse_args(argv)
    engine = MemoryViT.from_timm("vit_tiny_patch16_224", **BASE)
    print(environment("one block of width 32, 32x32 inputs, the pass stubbed", "8 adapters", "95 KiB JPEG"))
    print(f"{args.clients} clients, {args.seconds:g} s of load per server\n")
    print("| processes | heap | req/s | process | full collections | ms each |")
    print("|---|---|--:|---|--:|---|")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        weights = root / "base.safetensors"
        save_base(engine.base, weights, arch="vit_tiny_patch16_224", model_kwargs=BASE)
        store = root / "store"
        store.mkdir()
        for i in range(8):
            adapter = random_adapter(f"task-{i}", engine, m=1, classes=10)
            (store / f"task-{i}.safetensors").write_bytes(bundle_for(adapter, engine).to_bytes())
        for config in args.configs:
            for frozen in (False, True):
                rate, pauses = measure(config, frozen, root / f"{config}-{frozen}", weights, store, args)
                heap = "frozen" if frozen else "not frozen"
                if not pauses:
                    print(f"| {config} | {heap} | {rate:.0f} | - | 0 | - |", flush=True)
                for who, ms in sorted(pauses.items()):
                    each = ", ".join(f"{x:.0f}" for x in ms)
                    print(f"| {config} | {heap} | {rate:.0f} | {who} | {len(ms)} | {each} |", flush=True)


if __name__ == "__main__":
    main()
