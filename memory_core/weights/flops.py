"""The analytic cost model (docs/design.md §2.4): the yardstick measured times are compared with.

FLOPs count a multiply-add as 2. Per layer, with T base tokens, width D and MLP width F:

    base:     2T(4D^2 + 2DF) + 4T^2 D        (projections + MLP, then scores and weighted sum)
    adapter:  2(4D^2 + 2DF) + 4(T + A + P)D  (one class token; A lineage class tokens, P memory keys)

plus the patch embedding once and each head's 2CD. Memory keys/values cost nothing per pass: they
are projected once at registration (docs/design.md §2.2). LayerNorms, softmax and GELU are not counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .spec import ViTSpec


@dataclass(frozen=True)
class AdapterCost:
    """What one adapter's cost depends on."""

    num_memory: int  # P: memory keys it attends to per layer (its own plus its ancestors')
    num_classes: int  # C: rows of its head
    lineage: int = 1  # A: class tokens it attends to (itself, plus ancestors in extension mode)


def _token_layer_flops(spec: ViTSpec) -> int:
    D, F = spec.width, spec.mlp_hidden
    return 2 * (4 * D * D + 2 * D * F)


def base_flops(spec: ViTSpec) -> int:
    """FLOPs of the base model alone on one image."""
    T, D = spec.num_tokens, spec.width
    per_layer = T * _token_layer_flops(spec) + 4 * T * T * D
    patch_embed = 2 * spec.num_patches * spec.patch_pixels * D
    head = 2 * spec.num_classes * D
    return patch_embed + spec.depth * per_layer + head


def adapter_flops(spec: ViTSpec, cost: AdapterCost) -> int:
    """Extra FLOPs one adapter adds to the fused pass, per image."""
    T, D = spec.num_tokens, spec.width
    per_layer = _token_layer_flops(spec) + 4 * (T + cost.lineage + cost.num_memory) * D
    return spec.depth * per_layer + 2 * cost.num_classes * D


def fused_flops(spec: ViTSpec, adapters: Sequence[AdapterCost]) -> int:
    return base_flops(spec) + sum(adapter_flops(spec, a) for a in adapters)


def flop_ratio(spec: ViTSpec, adapters: Sequence[AdapterCost]) -> float:
    """R(K) = fused / base-only: the floor for a measured time ratio."""
    return fused_flops(spec, adapters) / base_flops(spec)


def uniform_adapters(k: int, num_memory: int, num_classes: int) -> list[AdapterCost]:
    """K identical concatenation-mode adapters, the benchmark's setting."""
    return [AdapterCost(num_memory=num_memory, num_classes=num_classes)] * k
