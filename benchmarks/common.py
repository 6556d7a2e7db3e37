"""What the benchmarks share: where the shared data lives, how a run is set up and described, timing.

The shared data (real DeiT-Tiny weights, ImageNet labels, photos, CIFAR-10 tarballs) is looked for in
``$MEMVIT_SHARED_DATA``, by default ``<repo>/../shared/data`` (the tests look in the same place).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from memvit.memory_core import MemoryViT
from memvit.memory_core.runtime import tune_malloc

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("MEMVIT_SHARED_DATA", REPO.parent / "shared" / "data"))
DEIT_TINY = SHARED_DATA / "deit_tiny" / "deit_tiny_patch16_224.pipevit_mat_in1k.safetensors"
IMAGENET_LABELS = SHARED_DATA / "imagenet_labels" / "synset_words.txt"
NATURAL_PHOTOS = SHARED_DATA / "photos" / "natural"
CIFAR10 = SHARED_DATA / "cifar10"


def argument_parser(file: str, doc: str | None) -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks.<file's stem>``, described by its docstring's first line."""
    return argparse.ArgumentParser(
        prog=f"python -m benchmarks.{Path(file).stem}", description=(doc or "").split("\n")[0]
    )


def natural_photos() -> list[Path]:
    """The real photos in ``NATURAL_PHOTOS``, in name order."""
    if not NATURAL_PHOTOS.is_dir():
        raise FileNotFoundError(f"{NATURAL_PHOTOS} not found (set MEMVIT_SHARED_DATA to the shared data)")
    return sorted(NATURAL_PHOTOS.iterdir())


def deit_tiny_engine(*, labels: bool = False) -> MemoryViT:
    """The real DeiT-Tiny (ImageNet weights), with its 1000 ImageNet labels if ``labels``."""
    if not DEIT_TINY.is_file():
        raise FileNotFoundError(f"real DeiT-Tiny weights not found at {DEIT_TINY} (set MEMVIT_SHARED_DATA)")
    names = None
    if labels:
        lines = IMAGENET_LABELS.read_text().splitlines()
        names = tuple(line.strip() for line in lines if line.strip())
    return MemoryViT.from_timm(weights=str(DEIT_TINY), labels=names)


def pin_malloc(enabled: bool = True) -> str:
    """Pin glibc's malloc thresholds as ``memvit``'s entry points do (memory_core/runtime.py), unless
    not ``enabled``. Returns what is in effect, for ``environment``."""
    return "heap-pinned malloc" if enabled and tune_malloc() else "glibc defaults"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(*details: str) -> str:
    """One line describing the run: torch, threads, CPU, then ``details``."""
    return ", ".join(
        (
            f"torch {torch.__version__}",
            f"{torch.get_num_threads()} threads",
            cpu_model(),
            f"{os.cpu_count()} CPUs",
            *details,
        )
    )


def timed(fn: Callable[[], object], clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds one call of ``fn`` takes (on ``clock``: wall by default, ``time.thread_time`` for this
    thread's CPU)."""
    start = clock()
    fn()
    return clock() - start


def interleaved(
    fns: Mapping[str, Callable[[], object]],
    rounds: int,
    *,
    clock: Callable[[], float] = time.perf_counter,
    alternate: bool = False,
) -> dict[str, list[float]]:
    """Seconds per call of each of ``fns``, after one warm-up call each, in ``rounds`` rounds that call
    them one after the other, so that a slow minute of a shared machine hits every one alike.
    ``alternate``: every other round in the reverse order, so that none always runs after the same
    one (whose cache it inherits)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in reversed(names) if alternate and r % 2 else names:
            times[name].append(timed(fns[name], clock))
    return times


def median_ratio(times: Mapping[str, list[float]], a: str, b: str) -> float | None:
    """Median over rounds of time(a) / time(b), both measured in the same round; None if one is missing."""
    if a not in times or b not in times:
        return None
    return statistics.median(ta / tb for ta, tb in zip(times[a], times[b], strict=True))
