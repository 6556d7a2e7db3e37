"""``memvit inspect``: an adapter bundle's metadata, validated on its own (no base needed).

memvit inspect my-adapter.safetensors
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from .common import fail


def inspect(bundle: Annotated[Path, typer.Argument(help="adapter bundle (.safetensors)")]) -> None:
    """Validate an adapter bundle on its own and print its metadata."""
    from memvit.adapters import BundleError, read_bundle

    try:
        description = read_bundle(bundle).describe()
    except BundleError as exc:
        raise fail(exc) from None
    typer.echo(json.dumps(description, indent=2))
