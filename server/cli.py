"""The ``memvit`` command line.

memvit info deit_tiny_patch16_224 --adapters 8 --memory 5     # shape, fingerprint, cost model
memvit info --weights ../shared/data/deit_tiny/...safetensors
memvit inspect my-adapter.safetensors                        # a bundle's metadata, validated
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from .train_options import train_config, train_signature, train_sweep

if TYPE_CHECKING:
    from .settings import Settings

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
    from memory_core.runtime import tune_malloc

    # Every command runs passes over and over (serve, train, eval): keep activations in the heap.
    tune_malloc()


@app.command()
def info(
    arch: Annotated[str | None, typer.Argument(help="timm architecture (optional with --weights)")] = None,
    weights: Annotated[Path | None, typer.Option(help="local .safetensors/.pth weights")] = None,
    adapters: Annotated[int, typer.Option(help="K adapters for the cost model")] = 8,
    memory: Annotated[int, typer.Option(help="memory tokens per layer per adapter")] = 1,
    classes: Annotated[int, typer.Option(help="classes per adapter head")] = 1000,
) -> None:
    """Check that a model can host adapters, and print its shape, fingerprint and FLOP ratios."""
    from memory_core import MemvitError, base_flops, flop_ratio, uniform_adapters

    try:
        engine = _engine(arch, weights)
    except MemvitError as exc:
        raise _fail(exc) from None
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
        raise _fail(exc) from None
    typer.echo(json.dumps(description, indent=2))


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="bind address (MEMVIT_HOST)")] = None,
    port: Annotated[int | None, typer.Option(help="port (MEMVIT_PORT)")] = None,
    model: Annotated[str | None, typer.Option(help="timm architecture (MEMVIT_MODEL)")] = None,
    weights: Annotated[Path | None, typer.Option(help="base weights (MEMVIT_WEIGHTS)")] = None,
    adapter_store: Annotated[
        str | None,
        typer.Option(help="adapter directory or s3://bucket/prefix (MEMVIT_ADAPTER_STORE)"),
    ] = None,
) -> None:
    """Serve the HTTP API. Settings come from MEMVIT_* variables; with none, the embedded demo."""
    import uvicorn
    from pydantic import ValidationError

    from .app import create_app, preflight
    from .settings import Settings
    from .timeouts import header_timeout_protocol

    overrides = {
        "host": host,
        "port": port,
        "model": model,
        "weights": weights,
        "adapter_store": adapter_store,
    }
    try:
        settings = Settings(**{k: v for k, v in overrides.items() if v is not None})
        preflight(settings)
    except ValidationError as exc:
        problems = "; ".join(
            f"MEMVIT_{'_'.join(map(str, e['loc'])).upper()}: {e['msg']}" for e in exc.errors()
        )
        raise _fail(ValueError(f"invalid settings: {problems}")) from None
    except (ValueError, OSError) as exc:
        raise _fail(exc) from None
    logging.getLogger().setLevel(settings.log_level.upper())
    settings = loopback_admin_default(settings)
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=10,
        http=header_timeout_protocol(settings.header_timeout_seconds),
    )


def loopback_admin_default(settings: Settings) -> Settings:
    """``memvit serve`` on a loopback address with no admin token leaves adapter management open
    (the laptop demo stays one command), saying so in one line. Never for any other address (the
    image binds 0.0.0.0), and never over an explicit MEMVIT_ALLOW_ANONYMOUS_ADMIN."""
    import ipaddress

    if settings.admin_token is not None or "allow_anonymous_admin" in settings.model_fields_set:
        return settings
    host = settings.host.strip("[]")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost: it may resolve to anything
        loopback = False
    if not loopback:
        return settings
    logging.getLogger("memvit.server").warning(
        "no MEMVIT_ADMIN_TOKEN and bound to loopback %s: POST/DELETE /adapters are open to local clients "
        "(set MEMVIT_ADMIN_TOKEN, or MEMVIT_ALLOW_ANONYMOUS_ADMIN=false, to close them)",
        settings.host,
    )
    return settings.model_copy(update={"allow_anonymous_admin": True})


def _engine(arch: str | None, weights: Path | None, labels: tuple[str, ...] | None = None):
    from memory_core import MemoryViT

    return MemoryViT.from_timm(arch, weights=str(weights) if weights else None, labels=labels)


def _read_labels(path: Path) -> tuple[str, ...]:
    """Class names, one per line, in the head's order (trailing blank lines ignored)."""
    try:
        lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    except OSError as exc:
        raise ValueError(f"--labels {path}: {exc.strerror or exc}") from None
    while lines and not lines[-1]:
        lines.pop()
    if not lines:
        raise ValueError(f"--labels {path}: no class names")
    if "" in lines:
        raise ValueError(f"--labels {path}: line {lines.index('') + 1} is empty")
    return tuple(lines)


def _fail(exc: Exception) -> typer.Exit:
    typer.echo(f"error: {exc}", err=True)
    return typer.Exit(code=2)


# -- memvit train: its options are TrainConfig's fields (server/train_options.py), plus these ---------


def _train_command_options(
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
    quiet: Annotated[bool, typer.Option(help="no progress bar")] = False,
) -> None:
    """Declares the options of ``memvit train`` that are not TrainConfig fields."""


def train(ctx: typer.Context, **options: Any) -> None:
    """Fine-tune one adapter on an image folder against a frozen base and write its bundle."""
    from adapters.training import train_adapter
    from memory_core import MemvitError

    try:
        config = train_config(ctx, options)
        sweep = train_sweep(options)
        if sweep:
            _train_sweep(config, sweep, options)
            return
        out = options["out"] or Path(f"{config.name}.safetensors")
        result = train_adapter(
            _engine(options["arch"], options["weights"]),
            config,
            out=out,
            checkpoint=options["checkpoint"] or out.with_suffix(".ckpt"),
            checkpoint_every=options["checkpoint_every"],
            resume=options["resume"],
            progress=not options["quiet"],
        )
    except (MemvitError, ValueError) as exc:
        raise _fail(exc) from None
    typer.echo(
        f"{out}: {result.steps} steps, val top-1 {result.val.top1:.4f}, top-5 {result.val.top5:.4f} "
        f"({result.val.images} images), {result.seconds:.0f}s"
    )


def _train_sweep(config: Any, sweep: dict[str, list[Any]], options: dict[str, Any]) -> None:
    from adapters.training.sweep import run_sweep

    out_dir = options["out"] or Path(f"{config.name}-sweep")
    result = run_sweep(
        _engine(options["arch"], options["weights"]),
        config,
        sweep,
        out_dir=out_dir,
        progress=not options["quiet"],
        curve_points=options["curve_points"],
        checkpoint=options["checkpoint"] or out_dir / "sweep.ckpt",
        checkpoint_every=options["checkpoint_every"],
        resume=options["resume"],
    )
    for i, variant in enumerate(result.variants):
        val = variant.result.val
        mark = "  <- chosen" if i == result.best else ""
        typer.echo(f"{variant.config.name}: val top-1 {val.top1:.4f}, top-5 {val.top5:.4f}{mark}")
    typer.echo(
        f"{out_dir}: {len(result.variants)} variants in one run, {result.chosen.result.steps} steps, "
        f"{result.chosen.result.seconds:.0f}s; chosen {result.chosen.config.name} as "
        f"{out_dir / (config.name + '.safetensors')}; report {out_dir / 'sweep.md'}"
    )


train.__signature__ = train_signature(_train_command_options)  # typer reads the options from here
app.command()(train)


@app.command("eval")
def evaluate(
    val: Annotated[list[str], typer.Option(help="TASK=DIR, once per task ('base' for the base model)")],
    adapter: Annotated[list[Path] | None, typer.Option(help="adapter bundle to load (repeat)")] = None,
    arch: Annotated[str | None, typer.Option(help="timm architecture of the base")] = None,
    weights: Annotated[Path | None, typer.Option(help="base weights")] = None,
    batch_size: Annotated[int, typer.Option()] = 64,
    workers: Annotated[int, typer.Option()] = 0,
    limit: Annotated[int | None, typer.Option(help="at most this many images per class")] = None,
    labels: Annotated[
        Path | None,
        typer.Option(help="class names of the base's head, one per line (for weights that carry none)"),
    ] = None,
    decode: Annotated[
        str, typer.Option(help="exact (every pixel) or fast (large JPEGs shrunk while decoding), as serve's")
    ] = "exact",
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Top-1/top-5 of the base and of each adapter through ONE fused model, checked against each alone."""
    from adapters import attach_bundle
    from adapters.training import evaluate_tasks
    from adapters.training.metrics import LabelMatchError
    from memory_core import BASE_TASK, LiveAdapters, MemvitError

    engine = None
    try:
        tasks = dict(_task_dir(item) for item in val)
        engine = _engine(arch, weights, labels=_read_labels(labels) if labels else None)
        live = LiveAdapters(engine)
        for path in adapter or []:
            attach_bundle(live, path)
        reports = evaluate_tasks(
            live, tasks, batch_size=batch_size, workers=workers, limit=limit, decode=decode
        )
    except LabelMatchError as exc:
        if exc.task == BASE_TASK and exc.matches == 0 and engine is not None and engine.labels is None:
            raise _fail(
                ValueError(
                    f"{exc}; the base weights carry no class names (its labels are class_0, class_1, ...): "
                    "give them with --labels FILE, one per line in the head's order "
                    "(ImageNet's synset_words.txt matches synset folders such as n01440764)"
                )
            ) from None
        raise _fail(exc) from None
    except (MemvitError, ValueError) as exc:
        raise _fail(exc) from None
    if as_json:
        typer.echo(json.dumps([_report_dict(r) for r in reports], indent=2))
    else:
        typer.echo(f"{'task':24} {'images':>7} {'top-1':>7} {'top-5':>7} {'alone top-1':>12}  unchanged")
        for r in reports:
            alone = "-" if r.alone is None else f"{r.alone.top1:.4f}"
            typer.echo(
                f"{r.task:24} {r.fused.images:7d} {r.fused.top1:7.4f} {r.fused.top5:7.4f} {alone:>12}  "
                f"{'yes' if r.unchanged else 'NO'} (max logit diff {r.max_logit_diff:.2e})"
            )
    if not all(r.unchanged for r in reports):
        raise typer.Exit(code=1)


def _task_dir(item: str) -> tuple[str, Path]:
    task, sep, folder = item.partition("=")
    if not sep or not task or not folder:
        raise ValueError(f"--val expects TASK=DIR, got {item!r}")
    return task, Path(folder)


def _report_dict(r) -> dict:
    return {
        "task": r.task,
        "images": r.fused.images,
        "top1": r.fused.top1,
        "top5": r.fused.top5,
        "alone_top1": None if r.alone is None else r.alone.top1,
        "max_logit_diff": r.max_logit_diff,
        "unchanged": r.unchanged,
    }


if __name__ == "__main__":
    app()
