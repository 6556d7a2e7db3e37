"""The ``memvit`` console script, run in-process through typer's runner."""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

import adapters.training
from adapters import bundle_for, save_bundle
from adapters.training import Accuracy, TrainConfig
from server.cli import app
from tests.conftest import IMAGENET_LABELS, make_folder, random_adapter

runner = CliRunner()


def test_info_prints_shape_and_cost_model() -> None:
    result = runner.invoke(app, ["info", "deit_tiny_patch16_224", "--adapters", "8", "--memory", "5"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["tokens"] == 197 and report["depth"] == 12
    assert abs(report["flop_ratio"]["8"] - 1.041) < 1e-3


def test_info_refuses_a_model_without_class_token() -> None:
    result = runner.invoke(app, ["info", "vit_base_patch16_siglip_224"])
    assert result.exit_code == 2
    assert "has no class token" in result.output


def test_inspect_valid_and_broken_bundles(tmp_path, engine) -> None:
    path = save_bundle(bundle_for(random_adapter("cli", engine, m=2), engine), tmp_path / "cli.safetensors")
    result = runner.invoke(app, ["inspect", str(path)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["memory_tokens"] == 2
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(path.read_bytes()[:-10])
    result = runner.invoke(app, ["inspect", str(broken)])
    assert result.exit_code == 2
    assert "truncated" in result.output


def test_train_then_eval_through_the_cli(tmp_path, tiny_weights, image_folder) -> None:
    out = tmp_path / "colours.safetensors"
    args = [
        "train",
        "--name",
        "colours",
        "--train-dir",
        str(image_folder),
        "--weights",
        str(tiny_weights),
        "--out",
        str(out),
        "--steps",
        "12",
        "--batch-size",
        "8",
        "--memory-tokens",
        "2",
        "--quiet",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "12 steps, val top-1" in result.output
    assert out.is_file() and out.with_suffix(".ckpt").is_file()
    result = runner.invoke(
        app,
        [
            "eval",
            "--weights",
            str(tiny_weights),
            "--adapter",
            str(out),
            "--val",
            f"colours={image_folder}",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    (report,) = json.loads(result.output)
    assert report["task"] == "colours" and report["unchanged"] is True
    assert report["images"] == 48


def test_train_reports_bad_folders_in_one_line(tmp_path, tiny_weights) -> None:
    result = runner.invoke(
        app,
        [
            "train",
            "--name",
            "x",
            "--train-dir",
            str(tmp_path / "nope"),
            "--weights",
            str(tiny_weights),
            "--quiet",
        ],
    )
    assert result.exit_code == 2
    assert "error: image folder not found" in result.output


def test_every_command_pins_malloc_before_running(monkeypatch) -> None:
    # The server's fused passes lose ~20% at batch 32 with glibc's default mmap threshold: every
    # command (serve, train, eval included) must pin it, as the benchmarks' raw passes do.
    import memory_core.runtime

    calls = []
    monkeypatch.setattr(memory_core.runtime, "tune_malloc", lambda: calls.append(1) or True)
    result = runner.invoke(app, ["info", "deit_tiny_patch16_224"])
    assert result.exit_code == 0, result.output
    assert calls == [1]


# -- memvit train's options are TrainConfig's fields -------------------------------------------------

TRAIN_HINTS = typing.get_type_hints(TrainConfig)
# Every field but `extra` (a free-form dict): a new field gets a case here and fails until it is an option.
CLI_FIELDS = [f for f in dataclasses.fields(TrainConfig) if f.name != "extra"]


def _changed(f: dataclasses.Field, tmp_path) -> object:
    """A valid value for a field that differs from its default."""
    special = {"name": "other-name", "memory_norm": "none", "memory_init": "normal"}
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
        return SimpleNamespace(steps=1, val=Accuracy(1.0, 1.0, 1), seconds=0.0)

    monkeypatch.setattr(adapters.training, "train_adapter", fake_train_adapter)
    return calls


def _train(tiny_weights, image_folder, *extra: str, name: str | None = "x"):
    args = ["train", "--weights", str(tiny_weights), "--train-dir", str(image_folder), "--quiet"]
    return runner.invoke(app, args + (["--name", name] if name else []) + list(extra))


@pytest.mark.parametrize("field", CLI_FIELDS, ids=[f.name for f in CLI_FIELDS])
def test_every_train_config_field_is_a_train_option(field, tmp_path, tiny_weights, image_folder, captured):
    value = _changed(field, tmp_path)
    assert value != field.default
    result = _train(tiny_weights, image_folder, *_option_args(field.name, value))
    assert result.exit_code == 0, result.output
    ((_, config, _),) = captured
    assert getattr(config, field.name) == value
    help_text = runner.invoke(app, ["train", "--help"], terminal_width=200).output
    assert "--" + field.name.replace("_", "-") in help_text


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


# -- memvit eval --labels --------------------------------------------------------------------------

SYNSETS = [
    "n01440764 tench, Tinca tinca",
    "n01443537 goldfish, Carassius auratus",
    "n01484850 great white shark, white shark, man-eater, man-eating shark, Carcharodon carcharias",
    "n01491361 tiger shark, Galeocerdo cuvieri",
    "n01494475 hammerhead, hammerhead shark",
    "n01496331 electric ray, crampfish, numbfish, torpedo",
    "n01498041 stingray",
]


def _synset_folder(root):
    """The colour folder with ImageNet-style class folders (n01440764, ...)."""
    folder = make_folder(root, per_class=2)
    for colour, synset in zip(sorted(p.name for p in folder.iterdir()), SYNSETS, strict=False):
        (folder / colour).rename(folder / synset.split()[0])
    return folder


def test_eval_base_with_labels_file(tmp_path, tiny_weights) -> None:
    val = _synset_folder(tmp_path / "val")
    labels = tmp_path / "labels.txt"
    labels.write_text("\n".join(SYNSETS) + "\n")  # 7 classes, as the tiny base's head
    args = ["eval", "--weights", str(tiny_weights), "--val", f"base={val}", "--json"]
    result = runner.invoke(app, [*args, "--labels", str(labels)])
    assert result.exit_code == 0, result.output
    (report,) = json.loads(result.output)
    assert report["task"] == "base" and report["images"] == 6 and report["unchanged"] is True
    result = runner.invoke(app, [*args, "--labels", str(labels), "--decode", "fast"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)[0]["images"] == 6
    result = runner.invoke(app, [*args, "--labels", str(labels), "--decode", "quick"])
    assert result.exit_code == 2 and "decode must be one of exact, fast" in result.output

    result = runner.invoke(app, args)  # the weights carry no class names: a hint, not just a mismatch
    assert result.exit_code == 2
    assert "folder class 'n01440764' matches 0 of the task's labels" in result.output
    assert "--labels FILE" in result.output

    labels.write_text("\n".join(SYNSETS[:3]))
    result = runner.invoke(app, [*args, "--labels", str(labels)])
    assert result.exit_code == 2
    assert "3 labels given for a head of 7 classes" in result.output


def test_eval_base_with_the_real_imagenet_labels(tmp_path) -> None:
    if not IMAGENET_LABELS.is_file():
        pytest.skip(f"ImageNet labels not found at {IMAGENET_LABELS} (../shared/data is absent)")
    from memory_core import save_base
    from tests.conftest import TINY, tiny_base

    weights = save_base(
        tiny_base(num_classes=1000).model,
        tmp_path / "in1k.safetensors",
        arch="vit_tiny_patch16_224",
        model_kwargs={**TINY, "num_classes": 1000},
    )
    val = _synset_folder(tmp_path / "val")
    result = runner.invoke(
        app,
        ["eval", "--weights", str(weights), "--val", f"base={val}", "--labels", str(IMAGENET_LABELS)],
    )
    assert result.exit_code == 0, result.output
    assert "base" in result.output
