"""The analytic cost model reproduces docs/design.md §2.4 and the reference R(K) figures in RESULTS."""

from __future__ import annotations

import functools

import pytest

from memvit.memory_core import (
    AdapterCost,
    MemoryViT,
    ViTSpec,
    adapter_flops,
    base_flops,
    flop_ratio,
    uniform_adapters,
)


@functools.cache
def spec_of(arch: str) -> ViTSpec:
    """An architecture's spec (a frozen dataclass), its model built once for the module: ViT-B/32's
    random init takes ~1.4 s."""
    return MemoryViT.from_timm(arch).spec


@pytest.mark.parametrize(
    "arch,k,m,expected",
    [
        ("vit_base_patch32_224", 8, 1, 1.157),
        ("vit_base_patch32_224", 64, 1, 2.258),
        ("deit_tiny_patch16_224", 8, 5, 1.041),
        ("deit_tiny_patch16_224", 64, 1, 1.328),
    ],
)
def test_ratio_matches_design_table(arch: str, k: int, m: int, expected: float) -> None:
    spec = spec_of(arch)
    assert flop_ratio(spec, uniform_adapters(k, m, 1000)) == pytest.approx(expected, abs=6e-4)


def test_base_flops_by_hand() -> None:
    spec = spec_of("vit_base_patch32_224")
    T, D, F, L = 50, 768, 3072, 12
    per_layer = 2 * T * (4 * D * D + 2 * D * F) + 4 * T * T * D
    assert base_flops(spec) == 2 * 49 * (3 * 32 * 32) * D + L * per_layer + 2 * 1000 * D
    one = adapter_flops(spec, AdapterCost(num_memory=5, num_classes=10))
    assert one == L * (2 * (4 * D * D + 2 * D * F) + 4 * (T + 1 + 5) * D) + 2 * 10 * D
    # Extension: attending to an ancestor's class token and memory costs only its scores.
    ext = adapter_flops(spec, AdapterCost(num_memory=5 + 2, num_classes=10, lineage=2))
    assert ext - one == L * 4 * (1 + 2) * D
