"""Adding and removing one adapter with K loaded, and what a loaded adapter costs in memory.

For K in {10, 100, 1,000} adapters (m memory tokens, C classes) on a random-init base (the cost
does not depend on the weights): the median time of ``LiveAdapters.add`` (prepare + new set +
install) and ``LiveAdapters.remove`` with K loaded, and of the routed pass of one image
asking for the new adapter, timed apart (a lazily built structure would show there); and the
resident memory (RSS) the K adapters add, against the bytes of their prepared tensors.

    python -m benchmarks.adapter_churn                  # ViT-B/32, m=1, 100 classes
    python -m benchmarks.adapter_churn --arch deit_tiny_patch16_224
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import statistics
import time
from pathlib import Path

import torch

from memvit.memory_core import LiveAdapters, MemoryViT
from tests.factories import random_adapter

from .common import argument_parser, environment, pin_malloc


def rss_bytes() -> int:
    """Resident memory after collecting garbage and handing freed heap back (malloc_trim), so that
    the figure counts what is held, not what the allocator keeps from freed temporaries."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def tensor_bytes(live: LiveAdapters) -> int:
    total = 0
    for a in live.current:
        for t in (a.cls, a.memory_keys, a.memory_values, a.head_weight, a.head_bias):
            total += t.numel() * t.element_size()
    return total


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--arch", default="vit_base_patch32_224")
    parser.add_argument("--counts", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--memory", type=int, default=1)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    print(environment(pin_malloc(), f"{args.arch}, m={args.memory}, {args.classes} classes"))
    torch.set_grad_enabled(False)
    engine = MemoryViT.from_timm(args.arch)
    live = LiveAdapters(engine)
    x = torch.randn(1, 3, *engine.spec.img_size)
    print("| adapters loaded | add (ms) | remove (ms) | next routed pass, 1 image (ms) "
          "| RSS per adapter (kB) | tensor bytes per adapter (kB) | ratio |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for count in args.counts:
        live.replace_all([])
        gc.collect()
        before = rss_bytes()
        weights = [random_adapter(f"a{i}", engine, m=args.memory, classes=args.classes) for i in range(count)]
        live.replace_all(weights)
        del weights
        gc.collect()
        added_rss = rss_bytes() - before
        per_adapter = tensor_bytes(live) / count
        extra = random_adapter("extra", engine, m=args.memory, classes=args.classes)
        adds, removes, passes = [], [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            live.add(extra)
            adds.append(time.perf_counter() - start)
            start = time.perf_counter()
            engine(x, live.current, tasks=[["extra"]])  # the first pass on the new set: nothing lazy left
            passes.append(time.perf_counter() - start)
            start = time.perf_counter()
            live.remove("extra")
            removes.append(time.perf_counter() - start)
        print(
            f"| {count:,} | {statistics.median(adds) * 1000:.2f} | {statistics.median(removes) * 1000:.2f} "
            f"| {statistics.median(passes) * 1000:.1f} | {added_rss / count / 1024:.1f} "
            f"| {per_adapter / 1024:.1f} | {added_rss / count / per_adapter:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
