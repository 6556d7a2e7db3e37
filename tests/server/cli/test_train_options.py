"""``memvit train``'s options are TrainConfig's fields, and ``--config FILE`` gives them too
(server/cli/train.py, config_file.py)."""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path
from types import SimpleNamespace

import pytest
import typer.main
from typer.testing import CliRunner

import memvit.adapters.training
from memvit.adapters.training import Accuracy, TrainConfig
from memvit.server.cli import app
from memvit.server.cli import train as train_module
from memvit.server.cli.train import CONFIG_PANEL
from tests.one_thread import one_torch_thread  # noqa: F401 (autouse, tests/one_thread.py)

runner = CliRunner()


# -- memvit train's options are TrainConfig's fields -------------------------------------------------

TRAIN_HINTS = typing.get_type_hints(TrainConfig)
# Every field but `extra` (a free-form dict): a new field gets a case here and fails until it is an option.
CLI_FIELDS = [f for f in dataclasses.fields(TrainConfig) if f.name != "extra"]
ALL_FIELDS = dataclasses.fields(TrainConfig)
# The options of `memvit train` that are the command's, not the config's.
COMMAND_OPTIONS = {
    "config", "out", "sweep", "curve_points", "arch", "weights", "checkpoint", "checkpoint_every", "resume",
    "quiet", "rebuild_cache",
}  # fmt: skip


def _changed(f: dataclasses.Field, tmp_path) -> object:
    """A valid value for a field that differs from its default."""
    special = {
        "name": "other-name",
        "memory_norm": "none",
        "memory_init": "normal",
        "cache_dtype": "bfloat16",
        "cache_views": 1,
        "cache_store": "keys-values",
        "cache_placement": "device",
        "device": "cpu",
        "precision": "bfloat16",
    }
    if f.name in special:
        return special[f.name]
    hint, default = TRAIN_HINTS[f.name], f.default
    if hint is bool:
        return not default
    if hint in (int, int | None):
        return (default or 0) + 3
    if hint in (float, float | None):
        return default / 2 if default else 0.5
    if hint == tuple[float, float]:
        return (0.25, 0.75)
    if hint in (str, str | None):
        return str(tmp_path / f"{f.name}-somewhere")
    if hint == dict[str, typing.Any]:
        return {"note": "kept", "round": 2}
    raise AssertionError(f"no test value for TrainConfig.{f.name} ({hint}): add one to _changed")


def _option_args(name: str, value) -> list[str]:
    option = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [option if value else "--no-" + name.replace("_", "-")]
    if isinstance(value, tuple):
        return [option, *map(str, value)]
    return [option, str(value)]


@pytest.fixture
def captured(monkeypatch) -> list:
    """Replaces train_adapter: records (engine, config, keywords) and returns a result to print."""
    calls = []

    def fake_train_adapter(engine, config, **kwargs):
        calls.append((engine, config, kwargs))
        return SimpleNamespace(steps=1, val=Accuracy(1.0, 1.0, 1), seconds=0.0, augmentation="none")

    monkeypatch.setattr(memvit.adapters.training, "train_adapter", fake_train_adapter)
    return calls


@pytest.fixture(scope="module")
def train_help() -> str:
    """``memvit train --help``, rendered once: it does not depend on the case (rich renders it in ~0.1 s)."""
    return runner.invoke(app, ["train", "--help"], terminal_width=200).output


def _train(tiny_weights, image_folder, *extra: str, name: str | None = "x"):
    args = ["train", "--weights", str(tiny_weights), "--train-dir", str(image_folder), "--quiet"]
    return runner.invoke(app, args + (["--name", name] if name else []) + list(extra))


@pytest.mark.parametrize("field", CLI_FIELDS, ids=[f.name for f in CLI_FIELDS])
def test_every_train_config_field_is_a_train_option(
    field, tmp_path, tiny_weights, image_folder, captured, train_help
):
    value = _changed(field, tmp_path)
    assert value != field.default
    result = _train(tiny_weights, image_folder, *_option_args(field.name, value))
    assert result.exit_code == 0, result.output
    ((_, config, _),) = captured
    assert getattr(config, field.name) == value
    assert "--" + field.name.replace("_", "-") in train_help


def _train_params() -> dict:
    """The train command's parameters as typer built them, by name."""
    command = typer.main.get_command(app).commands["train"]
    return {p.name: p for p in command.params}


def test_train_options_are_exactly_train_config_fields_with_its_defaults() -> None:
    # The command declares the fields itself (server/cli/train.py): a field added to TrainConfig and not
    # to the command, or an option left behind by a removed field, fails here.
    params = _train_params()
    in_panel = [name for name, p in params.items() if p.rich_help_panel == CONFIG_PANEL]
    assert in_panel == [f.name for f in CLI_FIELDS]  # every field but `extra`, in TrainConfig's order
    assert set(params) - set(in_panel) == COMMAND_OPTIONS
    for f in CLI_FIELDS:
        if f.default is dataclasses.MISSING:  # required: given here or in --config
            assert params[f.name].default is None, f.name
        else:
            assert params[f.name].default == f.default, f.name


def test_train_option_types_are_train_config_types() -> None:
    # What a type checker reads in train's signature is the field's type: a path for a path-valued
    # field (TrainConfig holds its string), and optional where the field is required (--config may give it).
    hints = typing.get_type_hints(train_module.train)
    for f in CLI_FIELDS:
        expected = TRAIN_HINTS[f.name]
        if f.default is dataclasses.MISSING:
            expected = expected | None
        given = hints[f.name]
        assert given == expected or given == _with_paths(expected), (f.name, given, expected)
    assert hints["return"] is type(None)


def _with_paths(hint):
    """``hint`` with str replaced by Path (the command line's type for a path-valued field)."""
    if hint is str:
        return Path
    args = typing.get_args(hint)
    return _with_paths(args[0]) | None if type(None) in args and len(args) == 2 else hint


@pytest.mark.parametrize("field", ALL_FIELDS, ids=[f.name for f in ALL_FIELDS])
def test_every_train_config_field_is_reachable_from_a_config_file(
    field, tmp_path, tiny_weights, image_folder, captured
) -> None:
    value = _changed(field, tmp_path)
    assert value != field.default
    config_file = tmp_path / "run.json"
    values = {"name": "x", "train_dir": str(image_folder), field.name: value}
    config_file.write_text(json.dumps({k.replace("_", "-"): v for k, v in values.items()}))
    args = ["train", "--weights", str(tiny_weights), "--quiet", "--config", str(config_file)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    ((_, config, _),) = captured
    assert getattr(config, field.name) == value


def test_train_passes_the_command_options_and_the_old_defaults(
    tmp_path, tiny_weights, image_folder, captured
):
    result = _train(
        tiny_weights, image_folder, "--val-dir", str(tmp_path / "val/"), "--checkpoint-every", "7"
    )
    assert result.exit_code == 0, result.output
    ((engine, config, kwargs),) = captured
    assert engine.source == str(tiny_weights)
    assert config == TrainConfig(name="x", train_dir=str(image_folder), val_dir=str(tmp_path / "val"))
    assert kwargs == {
        "out": Path("x.safetensors"),
        "checkpoint": Path("x.ckpt"),
        "checkpoint_every": 7,
        "resume": False,
        "progress": False,
        "rebuild_cache": False,
    }
    assert "extra" not in runner.invoke(app, ["train", "--help"], terminal_width=200).output


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_train_config_file_and_explicit_options_override_it(
    suffix, tmp_path, tiny_weights, image_folder, captured
) -> None:
    values = {
        "name": "from-file",
        "memory-tokens": 3,  # kebab-case and snake_case keys both work
        "token_lr_scale": 0.1,
        "crop-scale": [0.5, 1.0],
        "lr": 0.2,
        "head_only": False,
        "steps": 40,
        "extra": {"note": "kept"},
    }
    config_file = tmp_path / f"run{suffix}"
    if suffix == ".json":
        config_file.write_text(json.dumps(values))
    else:
        lines = [f"{k} = {json.dumps(v)}" for k, v in values.items() if k != "extra"]
        config_file.write_text("\n".join([*lines, "[extra]", 'note = "kept"', ""]))
    # --lr and --steps are given explicitly, --memory-tokens even at its default: they win over the file.
    result = _train(
        tiny_weights,
        image_folder,
        "--config",
        str(config_file),
        "--lr",
        "0.3",
        "--memory-tokens",
        "1",
        name=None,
    )
    assert result.exit_code == 0, result.output
    ((_, config, kwargs),) = captured
    assert config.name == "from-file" and kwargs["out"] == Path("from-file.safetensors")
    assert config.lr == 0.3 and config.memory_tokens == 1
    assert config.token_lr_scale == 0.1 and config.crop_scale == (0.5, 1.0) and config.steps == 40
    assert config.extra == {"note": "kept"}
    assert config.batch_size == 32  # neither in the file nor given: the default


def test_train_config_file_errors(tmp_path, tiny_weights, image_folder, captured) -> None:
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("learning-rate = 0.1\nlr = 0.2\n")
    result = _train(tiny_weights, image_folder, "--config", str(unknown))
    assert result.exit_code == 2
    assert "unknown key 'learning-rate'" in result.output
    wrong_type = tmp_path / "wrong.json"
    wrong_type.write_text(json.dumps({"batch_size": 2.5}))
    result = _train(tiny_weights, image_folder, "--config", str(wrong_type))
    assert result.exit_code == 2
    assert "batch_size must be" in result.output and "2.5" in result.output
    missing = tmp_path / "nothing.toml"
    missing.write_text("lr = 0.2\n")
    result = _train(tiny_weights, image_folder, "--config", str(missing), name=None)
    assert result.exit_code == 2
    assert "Missing option '--name'" in result.output
    assert captured == []
