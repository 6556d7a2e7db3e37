"""``memvit train --config FILE``: TrainConfig's fields, and a ``[sweep]`` table, from JSON or TOML.

Keys are snake_case or kebab-case; an unknown key is an error, and each value is checked against its
field's type. ``train_config`` merges the file with the command line: an option given on the command
line wins over the file, even at its default value; a field that neither gives keeps its default.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from memvit.adapters.training.config import TrainConfig

FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
# TrainConfig's fields that are options of `memvit train` (all but those marked `cli: False`).
OPTION_FIELDS = tuple(name for name, f in FIELDS.items() if f.metadata.get("cli", True))


def is_required(name: str) -> bool:
    """A field without a default (the command line may leave it to --config)."""
    f = FIELDS[name]
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


@dataclass(frozen=True)
class ConfigFile:
    """What a --config file gives: TrainConfig fields (checked against their types) and a sweep."""

    fields: dict[str, Any] = dataclasses.field(default_factory=dict)
    sweep: dict[str, list[Any]] = dataclasses.field(default_factory=dict)


def read_config_file(path: Path) -> ConfigFile:
    """A JSON or TOML table of TrainConfig fields, and its ``sweep`` table of FIELD = [values]."""
    from memvit.adapters.training.sweep import check_sweep

    hints = typing.get_type_hints(TrainConfig)
    fields: dict[str, Any] = {}
    sweep: dict[str, list[Any]] = {}
    for key, value in _read_table(path).items():
        if key == "sweep":  # the variants to train together
            if not isinstance(value, dict):
                raise ValueError(f"--config {path}: 'sweep' must be a table of FIELD = [values]")
            sweep = check_sweep({k.replace("-", "_"): v for k, v in value.items()})
            continue
        name = key.replace("-", "_")
        if name not in FIELDS:
            raise ValueError(
                f"--config {path}: unknown key {key!r} (TrainConfig fields: {', '.join(FIELDS)})"
            )
        if name in fields:
            raise ValueError(f"--config {path}: {name!r} is given twice")
        try:
            fields[name] = _file_value(hints[name], value)
        except TypeError:
            raise ValueError(f"--config {path}: {name} must be {hints[name]}, got {value!r}") from None
    return ConfigFile(fields, sweep)


def train_config(ctx: typer.Context, file: ConfigFile) -> TrainConfig:
    """The run's config: options given on the command line, then the file's fields, then the defaults.

    The options' values are read from ``ctx.params`` by field name, with where each came from."""
    values = dict(file.fields)
    for name in OPTION_FIELDS:
        if _given(ctx, name):
            value = ctx.params[name]
            values[name] = str(value) if isinstance(value, Path) else value  # TrainConfig holds strings
    for name in OPTION_FIELDS:
        if values.get(name) is None and is_required(name):
            ctx.fail(f"Missing option '--{name.replace('_', '-')}'.")
    return TrainConfig(**values)


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether option ``name`` was given (on the command line, or by its environment variable).

    By the source's name: newer typer releases carry their own copy of click, whose ParameterSource
    is another enum than ``click.core``'s."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")


def _read_table(path: Path) -> dict[str, Any]:
    """The top-level table of a JSON or TOML file."""
    suffix = path.suffix.lower()
    if suffix not in (".json", ".toml"):
        raise ValueError(f"--config {path}: expected a .json or .toml file")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"--config {path}: {exc.strerror or exc}") from None
    try:
        data = _parse(text, suffix)
    except ModuleNotFoundError:  # tomllib: Python 3.11+
        raise ValueError(f"--config {path}: reading TOML needs Python 3.11 or newer; use JSON") from None
    except ValueError as exc:  # JSONDecodeError and TOMLDecodeError are ValueErrors
        raise ValueError(f"--config {path}: not valid {suffix[1:].upper()}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a table of TrainConfig fields")
    return data


def _parse(text: str, suffix: str) -> Any:
    if suffix == ".json":
        return json.loads(text)
    import tomllib

    return tomllib.loads(text)


def _file_value(hint: Any, value: Any) -> Any:
    """A --config value checked against its field's type; TypeError if it does not fit."""
    args = typing.get_args(hint)
    if type(None) in args:
        if value is None:
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise TypeError
        hint, args = rest[0], typing.get_args(rest[0])
    if hint is bool and isinstance(value, bool):
        return value
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if hint is str and isinstance(value, str):
        return value
    if typing.get_origin(hint) is tuple and isinstance(value, (list, tuple)) and len(value) == len(args):
        return tuple(_file_value(a, v) for a, v in zip(args, value, strict=True))
    if typing.get_origin(hint) is dict and isinstance(value, dict):
        return value
    raise TypeError
