"""The ``memvit`` command line: one module per command.

memvit serve      serve.py     the HTTP API (settings from MEMVIT_* variables)
memvit train      train.py     fine-tune an adapter; with --sweep, many variants in one run
memvit eval       evaluate.py  accuracy of the base and each adapter through one fused model
memvit info       info.py      can a model host adapters: shape, fingerprint, cost model
memvit inspect    inspect.py   an adapter bundle's metadata, validated
memvit keys       keys.py      tenant API keys: add, list, revoke; their weights and limits
memvit usage      usage.py     requests, images and adapter rows per key, task and day

May import every package of memvit.server (the top layer): the commands build on all of them, and
nothing imports ``cli`` but the ``memvit`` entry point.
"""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from . import evaluate, info, inspect, keys, serve, train, usage
from .serve import gpu_host_default, loopback_admin_default

__all__ = ["app", "gpu_host_default", "loopback_admin_default"]

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
    from memvit.memory_core.runtime import tune_malloc

    # Every command runs passes over and over (serve, train, eval): keep activations in the heap.
    tune_malloc()


app.command()(info.info)
app.command()(inspect.inspect)
app.command()(serve.serve)
app.command()(train.train)
app.command("eval")(evaluate.evaluate)
app.add_typer(keys.app, name="keys")
app.command()(usage.usage)
