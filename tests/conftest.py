"""Shared test helpers and fixtures: tiny random ViTs and random adapters (from tests/factories.py), and
the real files in ../shared/data ($MEMVIT_SHARED_DATA; the paths are benchmarks/common.py's)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

# Without a GPU, the Triton kernels run under Triton's interpreter, so their results are held to the
# dense reference here too (memory_core/routing/triton_kernels.py). Triton reads this when it is first
# imported, which importing torch does not do, and memvit (below) does.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from PIL import Image

# Re-exported: the shared-data paths (one definition, benchmarks/common.py) and the factories
# (tests/factories.py), which tests import from here.
from benchmarks.common import DEIT_TINY, IMAGENET_LABELS, REPO, SHARED_DATA  # noqa: F401
from memvit.memory_core import MemoryViT, save_base
from tests.factories import TINY, VARIANTS, random_adapter, randomize, tiny_base, tiny_engine  # noqa: F401
from tests.http_clients import share_default_ssl_context

share_default_ssl_context()  # every httpx client of the tests on one SSL context (tests/http_clients.py)

TOL = 1e-5  # float32 on CPU: the exactness contract (docs/design.md §2.6)


def images(engine: MemoryViT, batch: int = 3, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    h, w = engine.spec.img_size
    return torch.randn(batch, engine.base.patch_embed.proj.in_channels, h, w, generator=g)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def assert_tasks_match(every, routed, tasks: list[list[str]], ref: dict[str, torch.Tensor]) -> None:
    """An all-tasks pass (``every``) and a routed one (``routed``, ``tasks`` per image) against the
    dense oracle's adapter logits ``ref``: every adapter for every image, and each routed task for
    exactly the images that asked for it."""
    for name, expected in ref.items():
        assert max_diff(every.adapters[name], expected) <= TOL
    for name, logits in routed.adapters.items():
        who = routed.images[name].tolist()
        assert who == [b for b, asked in enumerate(tasks) if name in asked]
        assert max_diff(logits, ref[name][who]) <= TOL


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
