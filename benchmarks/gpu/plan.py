"""What the suite measures: the grids of the full run on a GPU, and of ``--cpu-smoke`` (tiny shapes,
one or two rounds: the whole suite in well under a minute on CPU, so CI proves it still runs); plus
the models, inputs and timing every step shares."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from benchmarks.common import interleaved
from memvit.memory_core import AdapterWeights, MemoryViT
from tests.factories import TINY, random_adapter

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Random-init shapes for speed (no model hub on the device); "tiny" is the tests' 32x32 ViT.
ARCHS: dict[str, dict[str, Any]] = {
    "deit_tiny_patch16_224": {},
    "vit_base_patch32_224": {},
    "vit_base_patch16_224": {},
    "vit_large_patch16_224": {},
    "tiny": {"arch": "vit_tiny_patch16_224", **TINY},
}


@dataclass(frozen=True)
class Plan:
    device: torch.device
    smoke: bool = False
    archs: tuple[str, ...] = ("deit_tiny_patch16_224", "vit_base_patch32_224", "vit_base_patch16_224")
    large: tuple[str, ...] = ("vit_large_patch16_224",)  # engine step only, after the others
    dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16")
    batches: tuple[int, ...] = (64, 256)
    ks: tuple[int, ...] = (8, 64, 512, 1000)
    ms: tuple[int, ...] = (1, 5)
    classes: int = 100  # adapter head rows (1,000 heads of 100 classes: 400 MB at ViT-L in fp32)
    loaded: int = 1000  # adapters loaded for the routed pass
    # Adapters resident for the routed pass at scale (routing and memory steps, the largest arch):
    # ViT-B/16 bf16, m = 1, 100 classes holds ~40 GB; the all-tasks pass over them is skipped.
    huge_loaded: int = 100_000
    dense_k: int = 64
    memory_ks: tuple[int, ...] = (1000, 10000)
    memory_batch: int = 64
    rounds: int = 5
    train_batches: tuple[int, ...] = (64, 256)
    train_precisions: tuple[str, ...] = ("fp32", "bf16")  # the trainer's --precision, as dtype names
    # The training step's extras (training.py): the profiled step, the end-to-end regime against the
    # CPU's record and ``pytest -m cuda`` of the trainer; ``--steps training`` runs them, ``--all`` not.
    train_extras: bool = True
    variants: int = 8
    server_seconds: float = 20.0
    server_clients: tuple[int, ...] = (64,)
    server_models: tuple[str, ...] = ("deit_tiny_patch16_224", "vit_base_patch16_224")
    server_variants: int = 5  # of server.VARIANTS, for the first model (the others get the first)
    # Engine variants tried against the default, each reported: SDPA backends of the base path, CUDA
    # graphs on vs off, Triton vs torch kernels, the embedding ahead, the kernels' tiles (tries.py); on
    # these shapes, at the smallest batch.
    tries: tuple[str, ...] = ("sdpa", "graphs", "kernels", "ahead", "tiles")
    tries_on: tuple[str, ...] = ("deit_tiny_patch16_224", "vit_base_patch16_224")
    profiled: int = 3  # passes recorded per profile row (profiling.py)
    pytest_s: float = 240.0  # the longest ``pytest -m cuda`` may run (exactness.py)
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def smoke_plan(cls) -> Plan:
        return cls(
            device=torch.device("cpu"),
            smoke=True,
            archs=("tiny",),
            large=(),
            dtypes=("fp32", "bf16"),
            batches=(4,),
            ks=(1, 8),
            ms=(1,),
            classes=5,
            loaded=16,
            huge_loaded=64,
            dense_k=8,
            memory_ks=(8, 32),
            memory_batch=2,
            rounds=1,
            train_batches=(4,),
            variants=2,
            server_seconds=1.5,
            server_clients=(4,),
            server_models=("tiny",),
            server_variants=1,
            tries=("sdpa", "graphs", "kernels", "ahead", "tiles"),
            tries_on=("tiny",),
            profiled=1,
        )

    def narrowed(self, **fields: Any) -> Plan:
        """This plan with the command line's overrides (None: keep)."""
        return replace(self, **{k: v for k, v in fields.items() if v is not None})

    def settings(self) -> dict[str, Any]:
        keep = ("smoke", "archs", "dtypes", "batches", "ks", "ms", "classes", "loaded", "rounds")
        return {k: getattr(self, k) for k in keep}


def engine(arch: str, plan: Plan, dtype: str = "fp32", **kwargs: Any) -> MemoryViT:
    """A random-init base of ``arch``'s shape on the plan's device (seeded: every step sees the same)."""
    torch.manual_seed(0)
    spec = dict(ARCHS[arch])
    name = spec.pop("arch", arch)
    return MemoryViT.from_timm(name, device=plan.device, dtype=DTYPES[dtype], **spec, **kwargs)


def images(engine: MemoryViT, batch: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, *engine.spec.img_size, generator=g)
    return x.to(engine.device, engine.dtype)


def adapters(engine: MemoryViT, k: int, m: int, classes: int, prefix: str = "a") -> list[AdapterWeights]:
    return [
        random_adapter(f"{prefix}{i:05d}", engine, m=m, classes=classes, memory_std=0.02) for i in range(k)
    ]


def bank_adapters(
    engine: MemoryViT, k: int, m: int, classes: int, *, distinct: int = 256, prefix: str = "h"
) -> list[AdapterWeights]:
    """``k`` adapters sharing the tensors of ``distinct`` random ones, already on the engine's device
    and dtype: 100,000 of them in seconds and without 35 GB of host tensors. Each is its own adapter
    (its own name, prepared tensors and device slot); only its values repeat."""
    like = {"device": engine.device, "dtype": engine.dtype}
    bank = [
        replace(w, **{t: getattr(w, t).to(**like) for t in _TENSORS})
        for w in adapters(engine, min(k, distinct), m, classes, prefix="bank")
    ]
    return [replace(bank[i % len(bank)], name=f"{prefix}{i:06d}", check_values=False) for i in range(k)]


_TENSORS = ("memory", "cls_token", "head_weight", "head_bias")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_rounds(
    fns: dict[str, Callable[[], object]], device: torch.device, rounds: int
) -> dict[str, list[float]]:
    """Seconds per call of each fn in interleaved rounds (benchmarks/common.py), the device synced."""

    def synced(fn: Callable[[], object]) -> Callable[[], None]:
        def call() -> None:
            fn()
            sync(device)

        return call

    wrapped = {name: synced(fn) for name, fn in fns.items()}
    if device.type == "cuda":  # a second warm-up: cuDNN/cuBLAS heuristics, allocator growth
        for fn in wrapped.values():
            fn()
    return interleaved(wrapped, rounds)


def rate(times: list[float], batch: int) -> float:
    """Images/s from the median call time."""
    return batch / statistics.median(times)


def ratio(times: dict[str, list[float]], a: str, b: str) -> float:
    """Median over rounds of time(a) / time(b)."""
    return statistics.median(ta / tb for ta, tb in zip(times[a], times[b], strict=True))


def peak_mib(fn: Callable[[], object], device: torch.device) -> dict[str, float]:
    """Peak memory of one call: on CUDA the allocator's high-water mark (above what was allocated
    before, and in all), on CPU the profiler's high-water mark of tensor allocations."""
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        sync(device)
        peak = torch.cuda.max_memory_allocated(device)
        return {"peak_mib": peak / 2**20, "peak_over_resident_mib": (peak - before) / 2**20}
    from benchmarks.fused import peak_mb

    return {"peak_over_resident_mib": peak_mb(fn)}
