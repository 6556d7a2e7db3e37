"""What the commands share: loading the base, and turning an error into one line and exit code 2."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from memvit.memory_core import MemoryViT


def load_engine(arch: str | None, weights: Path | None, labels: tuple[str, ...] | None = None) -> MemoryViT:
    """The base from ``--arch`` and/or ``--weights`` (``memory_core`` is imported only when needed)."""
    from memvit.memory_core import MemoryViT

    return MemoryViT.from_timm(arch, weights=str(weights) if weights else None, labels=labels)


def fail(exc: Exception) -> typer.Exit:
    """Print ``error: ...`` on stderr; raise the returned Exit (code 2) ``from None``."""
    typer.echo(f"error: {exc}", err=True)
    return typer.Exit(code=2)
