"""``memvit eval``: top-1/top-5 of the base and of each adapter through ONE fused model.

memvit eval --weights base.safetensors --adapter flowers.safetensors --val flowers=flowers/val
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from .common import fail, load_engine

if TYPE_CHECKING:
    from memvit.adapters.training import TaskReport


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
    cache: Annotated[
        Path | None,
        typer.Option(
            help="activation cache directory: each task's images through the base once (DIR/TASK, built "
            "if absent, refused if built from other images, base or preprocessing); later runs read it"
        ),
    ] = None,
    cache_dtype: Annotated[
        str, typer.Option(help="storage dtype of --cache: float16, bfloat16 or float32 (float32: exact)")
    ] = "float16",
    cache_store: Annotated[
        str, typer.Option(help="what --cache keeps per layer: inputs or keys-values")
    ] = "inputs",
    rebuild_cache: Annotated[bool, typer.Option(help="build --cache afresh, whatever it holds")] = False,
    device: Annotated[
        str, typer.Option(help="where to score: auto (CUDA when present, else the CPU), cpu, cuda or cuda:N")
    ] = "auto",
    precision: Annotated[
        str,
        typer.Option(
            help="dtype of the base's pass: float32 (the served pass itself) or bfloat16 (autocast; the "
            "adapters' path in float32, as `memvit train --precision bfloat16` validates)"
        ),
    ] = "float32",
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Top-1/top-5 of the base and of each adapter through ONE fused model, checked against each alone."""
    from memvit.adapters import attach_bundle
    from memvit.adapters.training import evaluate_tasks
    from memvit.adapters.training.cache_key import CacheSpec
    from memvit.adapters.training.device import check_precision, resolve_device
    from memvit.adapters.training.metrics import LabelMatchError
    from memvit.memory_core import BASE_TASK, LiveAdapters, MemvitError

    engine = None
    try:
        tasks = dict(_task_dir(item) for item in val)
        check_precision(precision)
        target = resolve_device(device)
        engine = load_engine(arch, weights, labels=read_labels(labels) if labels else None).to(target)
        live = LiveAdapters(engine)
        for path in adapter or []:
            attach_bundle(live, path)
        spec = None
        if cache is not None:
            spec = CacheSpec(cache, cache_dtype, cache_store, 1, rebuild_cache, precision)
        reports = evaluate_tasks(
            live,
            tasks,
            batch_size=batch_size,
            workers=workers,
            limit=limit,
            decode=decode,
            cache=spec,
            precision=precision,
        )
    except LabelMatchError as exc:
        if exc.task == BASE_TASK and exc.matches == 0 and engine is not None and engine.labels is None:
            raise fail(
                ValueError(
                    f"{exc}; the base weights carry no class names (its labels are class_0, class_1, ...): "
                    "give them with --labels FILE, one per line in the head's order "
                    "(ImageNet's synset_words.txt matches synset folders such as n01440764)"
                )
            ) from None
        raise fail(exc) from None
    except (MemvitError, ValueError) as exc:
        raise fail(exc) from None
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


def read_labels(path: Path) -> tuple[str, ...]:
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


def _task_dir(item: str) -> tuple[str, Path]:
    task, sep, folder = item.partition("=")
    if not sep or not task or not folder:
        raise ValueError(f"--val expects TASK=DIR, got {item!r}")
    return task, Path(folder)


def _report_dict(r: TaskReport) -> dict[str, Any]:
    return {
        "task": r.task,
        "images": r.fused.images,
        "top1": r.fused.top1,
        "top5": r.fused.top5,
        "alone_top1": None if r.alone is None else r.alone.top1,
        "max_logit_diff": r.max_logit_diff,
        "unchanged": r.unchanged,
    }
