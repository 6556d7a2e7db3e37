"""``memvit train`` end to end, its bundle evaluated by ``memvit eval`` (server/cli/train.py)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from memvit.server.cli import app
from tests.one_thread import one_torch_thread  # noqa: F401 (autouse, tests/one_thread.py)

runner = CliRunner()


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
