"""The embedded offline demo: a small Fashion-MNIST ViT and two memory adapters, shipped in the repo.

``python -m server.demo.build`` rebuilds the files (see build.py); ``load_demo`` serves them.
"""

from __future__ import annotations

from pathlib import Path

from memory_core import MemoryViT

DEMO_DIR = Path(__file__).resolve().parent
BASE_WEIGHTS = DEMO_DIR / "base.safetensors"
ADAPTERS_DIR = DEMO_DIR / "adapters"


def demo_adapters() -> list[Path]:
    return sorted(ADAPTERS_DIR.glob("*.safetensors"))


def load_demo() -> MemoryViT:
    """The demo base with every demo adapter attached."""
    from adapters import attach_bundle

    engine = MemoryViT.from_timm(weights=BASE_WEIGHTS)
    for path in demo_adapters():
        attach_bundle(engine, path)
    return engine
