"""The ``memvit`` command line.

memvit info deit_tiny_patch16_224 --adapters 8 --memory 5     # shape, fingerprint, cost model
memvit info --weights ../shared/data/deit_tiny/...safetensors
memvit inspect my-adapter.safetensors                        # a bundle's metadata, validated
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    help="memvit: one frozen ViT plus learnable-memory adapters in one fused pass.", no_args_is_help=True
)


@app.callback()
def _main(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log at INFO level.")] = False,
) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )


@app.command()
def info(
    arch: Annotated[str | None, typer.Argument(help="timm architecture (optional with --weights)")] = None,
    weights: Annotated[Path | None, typer.Option(help="local .safetensors/.pth weights")] = None,
    adapters: Annotated[int, typer.Option(help="K adapters for the cost model")] = 8,
    memory: Annotated[int, typer.Option(help="memory tokens per layer per adapter")] = 1,
    classes: Annotated[int, typer.Option(help="classes per adapter head")] = 1000,
) -> None:
    """Check that a model can host adapters, and print its shape, fingerprint and FLOP ratios."""
    from memory_core import MemoryViT, MemvitError, base_flops, flop_ratio, uniform_adapters

    try:
        engine = MemoryViT.from_timm(arch, weights=str(weights) if weights else None)
    except MemvitError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from None
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


@app.command()
def inspect(bundle: Annotated[Path, typer.Argument(help="adapter bundle (.safetensors)")]) -> None:
    """Validate an adapter bundle on its own and print its metadata."""
    from adapters import BundleError, read_bundle

    try:
        description = read_bundle(bundle).describe()
    except BundleError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from None
    typer.echo(json.dumps(description, indent=2))


if __name__ == "__main__":
    app()
