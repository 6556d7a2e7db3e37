"""A sweep: many variants of one adapter trained in ONE run, chosen on validation, all written out.

    memvit train --name pets --train-dir data/pets --sweep lr=0.01,0.05 --sweep memory-tokens=0,1,5

Every combination of the swept values is a variant: its own adapter (named after the run and what
it changes, e.g. ``pets-lr0.05-m5``), with its own optimiser and schedule, trained in the same fused
passes as the others (``trainer.train_adapters``). Only fields each adapter owns can be swept
(``config.VARIANT_FIELDS``); the data, the steps and the augmentation are shared. The variant with
the best validation top-1 is also written under the run's own name, ready to register. Under
torchrun the variants are split across the processes, one GPU each (distributed.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import typing
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

from memvit.memory_core import AdapterError, MemoryViT, check_name

from ..bundle.format import bundle_for, save_bundle
from .config import VARIANT_FIELDS, TrainConfig, TrainingError
from .distributed import Ranks, train_across
from .report import write_report
from .results import SweepResult, SweepVariant
from .trainer import train_adapters

log = logging.getLogger(__name__)

SWEEPABLE = tuple(name for name in VARIANT_FIELDS if name != "name")
# Short tags for variant names: pets-lr0.05-tls30-m5.
_TAGS = {
    "lr": "lr",
    "token_lr_scale": "tls",
    "memory_lr_scale": "mls",
    "memory_tokens": "m",
    "head_only": "head",
    "memory_norm": "norm",
    "memory_init": "init",
    "momentum": "mom",
    "weight_decay": "wd",
    "warmup_fraction": "wu",
    "clip_grad": "clip",
    "init_seed": "s",
}


def parse_sweep(items: Sequence[str]) -> dict[str, list[Any]]:
    """``["lr=0.01,0.05", "memory-tokens=0,5"]`` -> {"lr": [0.01, 0.05], "memory_tokens": [0, 5]}."""
    sweep: dict[str, list[Any]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        name = key.strip().replace("-", "_")
        if not sep or not values.strip():
            raise TrainingError(f"--sweep {item!r}: expected FIELD=V1,V2,... (e.g. lr=0.01,0.05)")
        sweep[name] = [v.strip() for v in values.split(",")]
    return check_sweep(sweep)


def check_sweep(sweep: dict[str, Sequence[Any]]) -> dict[str, list[Any]]:
    """Validate field names and convert values (strings from a command line, or typed from a file)."""
    hints = typing.get_type_hints(TrainConfig)
    checked: dict[str, list[Any]] = {}
    for name, values in sweep.items():
        if name not in SWEEPABLE:
            shared = (
                "" if name not in hints else " (shared by every variant: it decides the data each step sees)"
            )
            sweepable = ", ".join(f.replace("_", "-") for f in SWEEPABLE)
            raise TrainingError(f"cannot sweep {name!r}{shared}; sweepable: {sweepable}")
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
            raise TrainingError(f"sweep {name}: give a non-empty list of values")
        converted = [_convert(name, hints[name], v) for v in values]
        if len(set(map(repr, converted))) != len(converted):
            raise TrainingError(f"sweep {name}: values repeat: {list(values)}")
        checked[name] = converted
    return checked


def _convert(name: str, hint: Any, value: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if args and len(args) == 1:
        if value is None or (isinstance(value, str) and value.lower() == "none"):
            return None
        hint = args[0]
    try:
        if hint is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
                return value.lower() in ("true", "1", "yes")
            raise ValueError
        if hint is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if hint is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if hint is str:
            return str(value)
    except ValueError:
        pass
    raise TrainingError(f"sweep {name}: {value!r} is not a valid {getattr(hint, '__name__', hint)}")


def expand(config: TrainConfig, sweep: dict[str, list[Any]]) -> list[tuple[TrainConfig, dict[str, Any]]]:
    """Every combination of the swept values applied to ``config``, named; equal variants only once."""
    keys = list(sweep)
    variants: list[tuple[TrainConfig, dict[str, Any]]] = []
    seen: dict[str, str] = {}
    for index, values in enumerate(itertools.product(*(sweep[k] for k in keys))):
        overrides = dict(zip(keys, values, strict=True))
        try:
            variant = dataclasses.replace(config, **overrides, name=_name(config.name, overrides, index))
        except TrainingError as exc:
            raise TrainingError(f"variant {overrides}: {exc}") from None
        key = _run_key(variant)
        if key in seen:
            log.info("variant %s is the same run as %s; trained once", overrides, seen[key])
            continue
        seen[key] = variant.name
        variants.append((variant, overrides))
    return variants


def _run_key(config: TrainConfig) -> str:
    """What makes two variants different runs. Head-only forces memory_tokens to 0, and a setting
    of something that does not learn (memory's lr with no memory) changes nothing."""
    fields = {k: v for k, v in dataclasses.asdict(config).items() if k != "name"}
    if config.memory_tokens == 0:
        for k in ("memory_lr_scale", "memory_norm", "memory_init"):
            fields.pop(k)
    if config.head_only:
        fields.pop("token_lr_scale")
    return json.dumps(fields, sort_keys=True, default=str)


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value).lower()


def _name(base: str, overrides: dict[str, Any], index: int) -> str:
    name = "-".join([base, *(f"{_TAGS.get(k, k)}{_fmt(v)}" for k, v in overrides.items())])
    try:
        check_name(name)
    except AdapterError:
        name = f"{base}-v{index:02d}"
    return name


def run_sweep(
    engine: MemoryViT,
    config: TrainConfig,
    sweep: dict[str, list[Any]],
    *,
    out_dir: str | Path | None = None,
    progress: bool = True,
    curve_points: int = 8,
    checkpoint: str | Path | None = None,
    checkpoint_every: int = 50,
    resume: bool = False,
    rebuild_cache: bool = False,
    ranks: Ranks | None = None,
) -> SweepResult:
    """Train every variant in one run; write each bundle, the chosen one as ``NAME``, and the report.
    ``ranks``: this process's place under torchrun (distributed.py): it trains its share of the
    variants, every rank gets every result, rank 0 writes the chosen bundle and the report."""
    variants = expand(config, check_sweep(sweep))
    log.info("sweep: %d variants of %s in one run", len(variants), config.name)
    out = None if out_dir is None else Path(out_dir)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    train = train_adapters if ranks is None else partial(train_across, ranks=ranks)
    results = train(
        engine,
        [c for c, _ in variants],
        outs=None if out is None else [out / f"{c.name}.safetensors" for c, _ in variants],
        progress=progress,
        curve_points=curve_points,
        checkpoint=checkpoint,
        checkpoint_every=checkpoint_every,
        resume=resume,
        rebuild_cache=rebuild_cache,
    )
    done = [SweepVariant(c, o, r) for (c, o), r in zip(variants, results, strict=True)]
    best = max(range(len(done)), key=lambda i: (done[i].result.val.top1, -i))  # ties: the first
    sweep_result = SweepResult(done, best, out)
    if out is not None and (ranks is None or ranks.rank == 0):
        chosen = done[best].result.bundle
        weights = dataclasses.replace(chosen.weights, name=config.name)
        training = {**(chosen.training or {}), "sweep_variant": done[best].config.name}
        save_bundle(bundle_for(weights, engine, training=training), out / f"{config.name}.safetensors")
        write_report(sweep_result, out)
    return sweep_result
