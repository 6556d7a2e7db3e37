"""``memvit train``: fine-tune one adapter against a frozen base, or with ``--sweep`` many variants in
one run, and write the bundles.

Its options are TrainConfig's fields (adapters/training/config.py), written out once in ``train``'s
signature with their types and defaults, so that typer, ``--help`` and a type checker all read the
same declaration; each option's help text is the field's own (``_field``). The signature cannot fall
behind the config: tests/server/cli/test_train_options.py checks that these options are exactly
TrainConfig's fields, with its defaults, and that every field can be set from the command line and
from ``--config`` (config_file.py: the file, and how the command line overrides it).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from .common import fail, load_engine
from .config_file import FIELDS, ConfigFile, is_required, read_config_file, train_config

if TYPE_CHECKING:
    from memvit.adapters.training.results import SweepResult

CONFIG_PANEL = "Training config (TrainConfig; also from --config)"


def _field(name: str) -> Any:
    """The option of TrainConfig field ``name``: its help text, in the config panel of ``--help``."""
    help_text = FIELDS[name].metadata["help"]
    if is_required(name):
        help_text += " (required; may come from --config)"
    return typer.Option(help=help_text, rich_help_panel=CONFIG_PANEL)


def train(
    ctx: typer.Context,
    # -- TrainConfig's fields, in its order (name and train_dir are required: here or in --config) --
    name: Annotated[str | None, _field("name")] = None,
    train_dir: Annotated[Path | None, _field("train_dir")] = None,
    val_dir: Annotated[Path | None, _field("val_dir")] = None,
    val_fraction: Annotated[float, _field("val_fraction")] = 0.1,
    memory_tokens: Annotated[int, _field("memory_tokens")] = 1,
    head_only: Annotated[bool, _field("head_only")] = False,
    memory_norm: Annotated[str, _field("memory_norm")] = "norm1",
    memory_init: Annotated[str, _field("memory_init")] = "tokens",
    parent: Annotated[Path | None, _field("parent")] = None,
    epochs: Annotated[float, _field("epochs")] = 5.0,
    steps: Annotated[int | None, _field("steps")] = None,
    batch_size: Annotated[int, _field("batch_size")] = 32,
    lr: Annotated[float, _field("lr")] = 0.05,
    token_lr_scale: Annotated[float, _field("token_lr_scale")] = 30.0,
    memory_lr_scale: Annotated[float, _field("memory_lr_scale")] = 1.0,
    momentum: Annotated[float, _field("momentum")] = 0.9,
    weight_decay: Annotated[float, _field("weight_decay")] = 0.0,
    warmup_fraction: Annotated[float, _field("warmup_fraction")] = 0.05,
    clip_grad: Annotated[float, _field("clip_grad")] = 1.0,
    crop_scale: Annotated[tuple[float, float], _field("crop_scale")] = (0.35, 1.0),
    hflip: Annotated[float, _field("hflip")] = 0.5,
    seed: Annotated[int, _field("seed")] = 0,
    init_seed: Annotated[int | None, _field("init_seed")] = None,
    cache: Annotated[Path | None, _field("cache")] = None,
    cache_dtype: Annotated[str, _field("cache_dtype")] = "float16",
    cache_views: Annotated[int, _field("cache_views")] = 2,
    cache_store: Annotated[str, _field("cache_store")] = "inputs",
    cache_placement: Annotated[str, _field("cache_placement")] = "auto",
    device: Annotated[str, _field("device")] = "auto",
    precision: Annotated[str, _field("precision")] = "float32",
    workers: Annotated[int | None, _field("workers")] = None,
    eval_batch_size: Annotated[int, _field("eval_batch_size")] = 64,
    # -- the command's own ---------------------------------------------------------------------------
    config: Annotated[
        Path | None,
        typer.Option(help="JSON or TOML file of TrainConfig fields; options given here override it"),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            help="bundle to write (default: NAME.safetensors); with --sweep, a directory (NAME-sweep)"
        ),
    ] = None,
    sweep: Annotated[
        list[str] | None,
        typer.Option(
            help="FIELD=V1,V2,...: train every combination in one run and keep the best on validation "
            "(repeat for more fields; also a [sweep] table in --config)"
        ),
    ] = None,
    curve_points: Annotated[
        int, typer.Option(help="with --sweep: validation scores per variant for the learning curves")
    ] = 8,
    arch: Annotated[str | None, typer.Option(help="timm architecture of the base")] = None,
    weights: Annotated[Path | None, typer.Option(help="base weights (.safetensors/.pth)")] = None,
    checkpoint: Annotated[Path | None, typer.Option(help="checkpoint file (default: OUT.ckpt)")] = None,
    checkpoint_every: Annotated[int, typer.Option(help="steps between checkpoints")] = 50,
    resume: Annotated[bool, typer.Option(help="continue from the checkpoint")] = False,
    rebuild_cache: Annotated[
        bool, typer.Option(help="with --cache: build the activation cache afresh, whatever it holds")
    ] = False,
    quiet: Annotated[bool, typer.Option(help="no progress bar")] = False,
) -> None:
    """Fine-tune one adapter on an image folder against a frozen base and write its bundle."""
    # The config fields above reach TrainConfig through ctx.params (train_config), which also knows
    # which of them were given on the command line and so override --config.
    from memvit.adapters.training import TrainingError, train_adapter
    from memvit.adapters.training import distributed as dist
    from memvit.adapters.training.sweep import parse_sweep, run_sweep
    from memvit.memory_core import MemvitError

    ranks = dist.Ranks.from_env()  # under torchrun: this process's share of a sweep (distributed.py)
    try:
        file = read_config_file(config) if config else ConfigFile()
        run_config = train_config(ctx, file)
        sweeps = {**file.sweep, **parse_sweep(sweep or [])}  # --sweep FIELD wins over the file's
        if ranks is not None and not sweeps:
            raise TrainingError(
                "torchrun splits a sweep's variants across processes (--sweep); one adapter trains in "
                "one process: run it without torchrun"
            )
        engine = load_engine(arch, weights)
        if sweeps:
            out = out or Path(f"{run_config.name}-sweep")
            swept = run_sweep(
                engine,
                run_config,
                sweeps,
                out_dir=out,
                progress=not quiet,
                curve_points=curve_points,
                checkpoint=checkpoint or out / "sweep.ckpt",
                checkpoint_every=checkpoint_every,
                resume=resume,
                rebuild_cache=rebuild_cache,
                ranks=ranks,
            )
            if ranks is None or ranks.rank == 0:
                _print_sweep(swept, run_config.name, out)
            return
        out = out or Path(f"{run_config.name}.safetensors")
        result = train_adapter(
            engine,
            run_config,
            out=out,
            checkpoint=checkpoint or out.with_suffix(".ckpt"),
            checkpoint_every=checkpoint_every,
            resume=resume,
            progress=not quiet,
            rebuild_cache=rebuild_cache,
        )
    except (MemvitError, ValueError) as exc:
        raise fail(exc) from None
    finally:
        if ranks is not None:
            dist.stop()
    typer.echo(
        f"{out}: {result.steps} steps, val top-1 {result.val.top1:.4f}, top-5 {result.val.top5:.4f} "
        f"({result.val.images} images), {result.seconds:.0f}s; augmentation: {result.augmentation}"
    )


def _print_sweep(result: SweepResult, name: str, out_dir: Path) -> None:
    """How each variant did, and where the chosen one and the report are."""
    for i, variant in enumerate(result.variants):
        val = variant.result.val
        mark = "  <- chosen" if i == result.best else ""
        typer.echo(f"{variant.config.name}: val top-1 {val.top1:.4f}, top-5 {val.top5:.4f}{mark}")
    chosen = result.chosen.result
    typer.echo(
        f"{out_dir}: {len(result.variants)} variants in one run, {chosen.steps} steps, "
        f"{chosen.seconds:.0f}s, augmentation: {chosen.augmentation}; chosen {result.chosen.config.name} "
        f"as {out_dir / (name + '.safetensors')}; report {out_dir / 'sweep.md'}"
    )
