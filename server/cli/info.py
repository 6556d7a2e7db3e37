"""``memvit info``: can a model host adapters? Its shape, fingerprint and cost model.

memvit info deit_tiny_patch16_224 --adapters 8 --memory 5
memvit info --weights ../shared/data/deit_tiny/...safetensors
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from .common import fail, load_engine


def info(
    arch: Annotated[str | None, typer.Argument(help="timm architecture (optional with --weights)")] = None,
    weights: Annotated[Path | None, typer.Option(help="local .safetensors/.pth weights")] = None,
    adapters: Annotated[int, typer.Option(help="K adapters for the cost model")] = 8,
    memory: Annotated[int, typer.Option(help="memory tokens per layer per adapter")] = 1,
    classes: Annotated[int, typer.Option(help="classes per adapter head")] = 1000,
) -> None:
    """Check that a model can host adapters, and print its shape, fingerprint and FLOP ratios."""
    from memvit.memory_core import MemvitError, base_flops, flop_ratio, uniform_adapters

    try:
        engine = load_engine(arch, weights)
    except MemvitError as exc:
        raise fail(exc) from None
    spec = engine.spec
    report = {
        "arch": spec.arch,
        "source": engine.source,
        "fingerprint": engine.fingerprint,
        "depth": spec.depth,
        "width": spec.width,
        "heads": spec.num_heads,
        "tokens": spec.num_tokens,
        "classes": spec.num_classes,
        "base_gflops": round(base_flops(spec) / 1e9, 3),
        "flop_ratio": {
            str(k): round(flop_ratio(spec, uniform_adapters(k, memory, classes)), 4)
            for k in sorted({1, adapters, 8, 64})
        },
    }
    typer.echo(json.dumps(report, indent=2))
