"""``memvit train``'s options are ``TrainConfig``'s fields, so the command cannot drift from the config.

One option per field (``--kebab-case``; type, default and help from the dataclass and its field
metadata), built as a signature that typer reads. A ``--config`` file (JSON or TOML, snake_case or
kebab-case keys) gives fields too; an option given on the command line wins over the file, and a
field nobody gave keeps its default.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from collections.abc import Callable
from inspect import Parameter, Signature, signature
from pathlib import Path
from typing import Annotated, Any

import typer

from adapters.training.config import TrainConfig

_CONFIG_PANEL = "Training config (TrainConfig; also from --config)"


def _cli_fields() -> list[dataclasses.Field]:
    """TrainConfig's fields that are command-line options (all but those marked ``cli: False``)."""
    return [f for f in dataclasses.fields(TrainConfig) if f.metadata.get("cli", True)]


def _is_required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _config_option(f: dataclasses.Field, hint: Any) -> Parameter:
    """The typer option for one TrainConfig field."""
    required = _is_required(f)  # required, but may come from --config: checked after merging
    optional = required or type(None) in typing.get_args(hint)
    if f.metadata.get("path"):
        hint = Path | None if optional else Path
    elif required:
        hint = hint | None
    default = None if required else f.default
    if default is dataclasses.MISSING:
        default = f.default_factory()
    help_text = f.metadata.get("help", "")
    if required:
        help_text += " (required; may come from --config)"
    option = typer.Option(help=help_text, rich_help_panel=_CONFIG_PANEL)
    return Parameter(f.name, Parameter.KEYWORD_ONLY, annotation=Annotated[hint, option], default=default)


def train_signature(command_options: Callable[..., None]) -> Signature:
    """``ctx``, one keyword option per TrainConfig field, then ``command_options``'s own parameters."""
    hints = typing.get_type_hints(TrainConfig)
    context = Parameter("ctx", Parameter.KEYWORD_ONLY, annotation=typer.Context)
    fields = [_config_option(f, hints[f.name]) for f in _cli_fields()]
    own = [
        p.replace(kind=Parameter.KEYWORD_ONLY)
        for p in signature(command_options, eval_str=True).parameters.values()
    ]
    clash = {p.name for p in own} & {p.name for p in fields}
    assert not clash, f"memvit train: TrainConfig fields {clash} clash with the command's own options"
    return Signature([context, *fields, *own], return_annotation=None)


def _parse_config(text: str, suffix: str) -> Any:
    if suffix == ".json":
        return json.loads(text)
    import tomllib

    return tomllib.loads(text)


def _read_config_table(path: Path) -> dict[str, Any]:
    """The top-level table of a JSON or TOML config file."""
    suffix = path.suffix.lower()
    if suffix not in (".json", ".toml"):
        raise ValueError(f"--config {path}: expected a .json or .toml file")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"--config {path}: {exc.strerror or exc}") from None
    try:
        data = _parse_config(text, suffix)
    except ModuleNotFoundError:  # tomllib: Python 3.11+
        raise ValueError(f"--config {path}: reading TOML needs Python 3.11 or newer; use JSON") from None
    except ValueError as exc:  # JSONDecodeError and TOMLDecodeError are ValueErrors
        raise ValueError(f"--config {path}: not valid {suffix[1:].upper()}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a table of TrainConfig fields")
    return data


def _read_config_file(path: Path) -> dict[str, Any]:
    """TrainConfig fields from a JSON or TOML file; keys in snake_case or kebab-case."""
    data = _read_config_table(path)
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key == "sweep":  # the variants to train together: read by train_sweep
            continue
        name = key.replace("-", "_")
        if name not in names:
            raise ValueError(
                f"--config {path}: unknown key {key!r} (TrainConfig fields: "
                f"{', '.join(f.name for f in dataclasses.fields(TrainConfig))})"
            )
        if name in values:
            raise ValueError(f"--config {path}: {name!r} is given twice")
        values[name] = value
    return values


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


def train_config(ctx: typer.Context, options: dict[str, Any]) -> TrainConfig:
    """The run's config: options given on the command line, then --config's values, then defaults."""
    path = options["config"]
    from_file = _read_config_file(path) if path else {}
    hints = typing.get_type_hints(TrainConfig)
    values: dict[str, Any] = {}
    for name, value in from_file.items():
        try:
            values[name] = _file_value(hints[name], value)
        except TypeError:
            raise ValueError(f"--config {path}: {name} must be {hints[name]}, got {value!r}") from None
    for f in _cli_fields():
        source = ctx.get_parameter_source(f.name)
        given = source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")
        if given or f.name not in values:
            value = options[f.name]
            if f.metadata.get("path") and value is not None:
                value = str(value)
            values[f.name] = value
        if values[f.name] is None and _is_required(f):
            ctx.fail(f"Missing option '--{f.name.replace('_', '-')}'.")
    return TrainConfig(**values)


def train_sweep(options: dict[str, Any]) -> dict[str, list[Any]]:
    """The sweep: a --config file's ``sweep`` table, then each ``--sweep FIELD=V1,V2`` (which wins)."""
    from adapters.training.sweep import check_sweep, parse_sweep

    sweep: dict[str, list[Any]] = {}
    path = options["config"]
    if path:
        table = _read_config_table(path).get("sweep", {})
        if not isinstance(table, dict):
            raise ValueError(f"--config {path}: 'sweep' must be a table of FIELD = [values]")
        sweep.update(check_sweep({k.replace("-", "_"): v for k, v in table.items()}))
    sweep.update(parse_sweep(options["sweep"] or []))
    return sweep
