"""The ``memvit`` console script, run in-process through typer's runner."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from adapters import bundle_for, save_bundle
from server.cli import app
from tests.conftest import random_adapter

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
