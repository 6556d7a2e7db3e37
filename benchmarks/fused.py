"""Fused pass vs the base alone, vs K+1 separate timm passes, vs the dense-mask oracle, in one run.

    python -m benchmarks.fused                       # the default grid, ~12 minutes on 2 CPU cores
    python -m benchmarks.fused --archs deit_tiny_patch16_224 --ks 0,8 --rounds 3   # a quick look

Random weights (timing does not depend on them; the adapters come from tests/factories.py). Each
configuration is timed in interleaved rounds (base, fused, dense, trimmed dense, one after the other)
and every ratio is the median of per-round ratios, so slow drifts of a shared machine cancel.
"separate" is K+1 plain timm passes run one after the other (a lower bound for K+1 separately
fine-tuned models, which would also carry memory).
Peak memory is the high-water mark of tensor allocations during one pass (torch profiler), that is
activations, not weights. Like ``memvit``'s entry points, it pins glibc's malloc thresholds
(memory_core/runtime.py) unless ``--default-malloc`` is given.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass

os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # keep the profiler's log lines out of the table

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import argument_parser, environment, interleaved, median_ratio, pin_malloc, timed
from memvit.memory_core import MemoryViT, flop_ratio, uniform_adapters
from memvit.memory_core.oracle.reference import DenseMemoryViT
from tests.factories import random_adapter


@dataclass
class Row:
    arch: str
    k: int
    m: int | None
    flop_ratio: float
    base_ms: float
    fused_ms: float
    fused_over_base: float
    fused_over_separate: float
    fused_over_dense: float | None
    fused_over_trimmed: float | None
    peak_fused_mb: float
    peak_dense_mb: float | None
    peak_base_mb: float

    def verdicts(self) -> list[str]:
        out = []
        if self.k > 0:
            slack = 0.10 if self.k <= 8 else 0.25
            over = self.fused_over_base / self.flop_ratio - 1
            out.append(f"{'ok' if over <= slack else 'MISS'} R{over:+.1%}")
        if self.k == 8:
            speedup = 1 / self.fused_over_separate
            out.append(f"{'ok' if speedup >= 7 else 'MISS'} {speedup:.1f}x sep")
        if self.k >= 8 and self.fused_over_dense is not None:
            out.append(f"{'ok' if self.fused_over_dense < 1 else 'MISS'} vs dense")
        return out


def peak_mb(fn: Callable[[], object]) -> float:
    """High-water mark of CPU tensor allocations during ``fn`` (MiB), from the profiler's memory events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak / 2**20


def bench_arch(arch: str, ks: list[int], ms: list[int], args: argparse.Namespace) -> list[Row]:
    engine = MemoryViT.from_timm(arch)
    engine.trim_last_block = {"auto": None, "on": True, "off": False}[args.trim]
    base = engine.base
    x = torch.randn(args.batch, 3, *engine.spec.img_size)
    rows: list[Row] = []
    separate_cache: dict[int, float] = {}

    def separate(k: int) -> float:
        # K+1 plain timm passes; repeated for small K, run once for large K (it is K+1 samples already).
        if k not in separate_cache:
            reps = max(1, min(args.rounds, 70 // (k + 1)))
            separate_cache[k] = statistics.median(
                timed(lambda: [base(x) for _ in range(k + 1)]) for _ in range(reps)
            )
        return separate_cache[k]

    for k in ks:
        for m in [None] if k == 0 else ms:
            adapters = [
                random_adapter(f"a{i}", engine, m=m or 0, classes=args.classes, memory_std=0.02)
                for i in range(k)
            ]
            adapter_set = engine.prepare_set(adapters)
            fns: dict[str, Callable[[], object]] = {
                "base": lambda: base(x),
                "fused": lambda s=adapter_set: engine(x, s),
            }
            if k > 0 and not args.no_dense:
                dense = DenseMemoryViT(base, adapters)
                trimmed = DenseMemoryViT(base, adapters, trim_memory=True)
                fns["dense"] = lambda d=dense: d(x)
                fns["trimmed"] = lambda d=trimmed: d(x)
            times = interleaved(fns, args.rounds)
            fused_s = statistics.median(times["fused"])
            row = Row(
                arch=arch,
                k=k,
                m=m,
                flop_ratio=flop_ratio(engine.spec, uniform_adapters(k, m or 0, args.classes)),
                base_ms=1e3 * statistics.median(times["base"]),
                fused_ms=1e3 * fused_s,
                fused_over_base=median_ratio(times, "fused", "base"),
                fused_over_separate=fused_s / separate(k),
                fused_over_dense=median_ratio(times, "fused", "dense"),
                fused_over_trimmed=median_ratio(times, "fused", "trimmed"),
                peak_fused_mb=peak_mb(fns["fused"]),
                peak_dense_mb=peak_mb(fns["dense"]) if "dense" in fns else None,
                peak_base_mb=peak_mb(fns["base"]),
            )
            print(format_row(row), flush=True)
            rows.append(row)
    return rows


HEADER = (
    "| arch | K | m | R(K) | fused/base | fused/separate | fused/dense | fused/dense-trimmed "
    "| base ms | fused ms | peak MiB base / fused / dense | targets |\n"
    "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|"
)


def _f(value: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if value is None else fmt.format(value)


def format_row(r: Row) -> str:
    peaks = f"{r.peak_base_mb:.0f} / {r.peak_fused_mb:.0f} / {_f(r.peak_dense_mb, '{:.0f}')}"
    return (
        f"| {r.arch} | {r.k} | {_f(r.m, '{}')} | {r.flop_ratio:.3f} | {r.fused_over_base:.3f} "
        f"| {r.fused_over_separate:.3f} | {_f(r.fused_over_dense)} | {_f(r.fused_over_trimmed)} "
        f"| {r.base_ms:.0f} | {r.fused_ms:.0f} | {peaks} | {', '.join(r.verdicts())} |"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--archs", default="vit_base_patch32_224,deit_tiny_patch16_224")
    parser.add_argument("--ks", default="0,1,8,64")
    parser.add_argument("--ms", default="1,5")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--classes", type=int, default=1000, help="adapter head rows (reference figures: 1000)"
    )
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-dense", action="store_true", help="skip the dense-mask oracle")
    parser.add_argument(
        "--trim",
        nargs="?",
        const="on",
        default="auto",
        choices=["auto", "on", "off"],
        help="the last block over the rows a head reads only (engine.trim_last_block; auto: on the CPU)",
    )
    parser.add_argument("--default-malloc", action="store_true", help="leave glibc's malloc thresholds alone")
    args = parser.parse_args(argv)
    malloc = pin_malloc(not args.default_malloc)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ks = [int(k) for k in args.ks.split(",")]
    ms = [int(m) for m in args.ms.split(",")]
    print(
        environment(
            f"batch {args.batch}",
            "fp32",
            f"{args.rounds} rounds",
            f"adapter heads of {args.classes} classes",
            malloc,
        )
    )
    print(HEADER, flush=True)
    with torch.inference_mode():
        for arch in args.archs.split(","):
            bench_arch(arch, ks, ms, args)


if __name__ == "__main__":
    main()
