"""Shared test helpers: tiny random ViTs, random adapters, and the real files in ../shared/data."""

from __future__ import annotations

import math
import os
import random
import zlib
from pathlib import Path

import pytest
import torch
from PIL import Image

from memory_core import AdapterWeights, BaseModel, MemoryViT, create_base, save_base

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("MEMVIT_SHARED_DATA", REPO.parent / "shared" / "data"))
DEIT_TINY = SHARED_DATA / "deit_tiny" / "deit_tiny_patch16_224.pipevit_mat_in1k.safetensors"
IMAGENET_LABELS = SHARED_DATA / "imagenet_labels" / "synset_words.txt"

TOL = 1e-5  # float32 on CPU: the contract of issue #2

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


def images(engine: MemoryViT, batch: int = 3, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    h, w = engine.spec.img_size
    return torch.randn(batch, engine.base.patch_embed.proj.in_channels, h, w, generator=g)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.fixture
def engine() -> MemoryViT:
    return tiny_engine()


@pytest.fixture(scope="session")
def deit_tiny_path() -> Path:
    if not DEIT_TINY.is_file():
        pytest.skip(f"real DeiT-Tiny weights not found at {DEIT_TINY} (../shared/data is absent)")
    return DEIT_TINY


COLOURS = {"red": (200, 40, 40), "green": (40, 180, 60), "blue": (40, 60, 200)}


def make_folder(root: Path, per_class: int = 10, seed: int = 0, size: int = 32) -> Path:
    """Three classes of noisy colour blobs at random places: easy, but not trivially constant."""
    rng = random.Random(seed)
    for name, (r, g, b) in COLOURS.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            image = Image.new("RGB", (size, size), tuple(rng.randint(90, 160) for _ in range(3)))
            x, y = rng.randint(0, size // 2), rng.randint(0, size // 2)
            jitter = [rng.randint(-30, 30) for _ in range(3)]
            blob = Image.new("RGB", (size // 2, size // 2), (r + jitter[0], g + jitter[1], b + jitter[2]))
            image.paste(blob, (x, y))
            image.save(root / name / f"{i:03d}.png")
    return root


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory) -> Path:
    return make_folder(tmp_path_factory.mktemp("colours") / "train", per_class=16)


@pytest.fixture(scope="session")
def tiny_weights(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("base") / "tiny.safetensors"
    return save_base(tiny_base().model, path, arch="vit_tiny_patch16_224", model_kwargs=TINY)
