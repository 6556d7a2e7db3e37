"""Tiny random ViTs and random adapters, for the tests and the benchmarks (no pytest needed).

``random_adapter``'s values are a function of (name, seed, engine shape, m, classes) only: tests
compare against them, so do not change how they are drawn.
"""

from __future__ import annotations

import math
import zlib

import torch

from memvit.memory_core import AdapterWeights, BaseModel, MemoryViT, create_base

# Tiny ViT variants covering what the engine must get right. All 32x32 inputs, 8x8 patches.
TINY = dict(img_size=32, patch_size=8, embed_dim=64, depth=3, num_heads=4, num_classes=7)
VARIANTS = {
    "plain": {},
    "registers": dict(reg_tokens=4, no_embed_class=True),
    "registers_embedded": dict(reg_tokens=2),
    "qknorm_layerscale_prenorm": dict(qk_norm=True, init_values=0.5, pre_norm=True),
}


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Replace timm's init (tiny class token, unit LayerNorms) by weights that make every part count."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2 and "embed" not in name and "token" not in name:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            else:  # biases, class/register tokens, position embeddings, layer scales
                p.copy_(0.5 * torch.randn(p.shape, generator=g))


def tiny_base(variant: str = "plain", seed: int = 0, **overrides) -> BaseModel:
    base = create_base("vit_tiny_patch16_224", **{**TINY, **VARIANTS[variant], **overrides})
    randomize(base.model, seed)
    return base


def tiny_engine(variant: str = "plain", seed: int = 0, **overrides) -> MemoryViT:
    return MemoryViT(tiny_base(variant, seed, **overrides))


def random_adapter(
    name: str,
    engine: MemoryViT,
    *,
    m: int = 1,
    classes: int = 5,
    memory_norm: str = "norm1",
    parent: str | None = None,
    seed: int = 0,
    memory_std: float = 1.0,
) -> AdapterWeights:
    """An adapter for ``engine`` with random memory, class token and head, seeded by ``name`` and ``seed``."""
    spec = engine.spec
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{seed}".encode()))
    # Class token and head first, so adapters differing only in m share them.
    cls_token = 0.5 * torch.randn(spec.width, generator=g)
    head_weight = torch.randn(classes, spec.width, generator=g) / math.sqrt(spec.width)
    head_bias = 0.1 * torch.randn(classes, generator=g)
    return AdapterWeights(
        name=name,
        memory=memory_std * torch.randn(spec.depth, m, spec.width, generator=g),
        cls_token=cls_token,
        head_weight=head_weight,
        head_bias=head_bias,
        memory_norm=memory_norm,
        parent=parent,
        labels=tuple(f"{name}-{i}" for i in range(classes)),
    )
