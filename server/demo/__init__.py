"""The embedded offline demo: a small Fashion-MNIST ViT and two memory adapters, shipped in the wheel.

``memvit serve`` with nothing configured serves these files. They are built from a source checkout by
``python -m benchmarks.build_demo`` (see benchmarks/build_demo.py), which writes them here.
"""

from __future__ import annotations

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent
BASE_WEIGHTS = DEMO_DIR / "base.safetensors"
ADAPTERS_DIR = DEMO_DIR / "adapters"
# Images the demo answers right, with where each comes from (samples/README.md); the page offers them.
SAMPLES_DIR = DEMO_DIR / "samples"


def demo_adapters() -> list[Path]:
    return sorted(ADAPTERS_DIR.glob("*.safetensors"))
