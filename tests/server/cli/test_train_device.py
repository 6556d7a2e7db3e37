"""``memvit train`` and ``memvit eval`` with ``--device`` and ``--precision`` (server/cli/train.py,
evaluate.py): the same command on the CPU in bfloat16 autocast, a device the machine lacks refused."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from memvit.adapters import read_bundle
from memvit.server.cli import app
from tests.one_thread import one_torch_thread  # noqa: F401 (autouse, tests/one_thread.py)

runner = CliRunner()


def _train(tiny_weights, image_folder, out, *extra: str):
    args = ["train", "--name", "colours", "--train-dir", str(image_folder), "--weights", str(tiny_weights)]
    args += ["--out", str(out), "--steps", "6", "--batch-size", "8", "--quiet", *extra]
    return runner.invoke(app, args)


def test_train_and_eval_on_the_cpu_in_bfloat16(tmp_path, tiny_weights, image_folder) -> None:
    out = tmp_path / "colours.safetensors"
    result = _train(tiny_weights, image_folder, out, "--device", "cpu", "--precision", "bfloat16")
    assert result.exit_code == 0, result.output
    bundle = read_bundle(out)
    assert bundle.training["hyper_parameters"]["precision"] == "bfloat16"
    assert bundle.training["device"] == "cpu"
    scores = {}
    for precision in ("float32", "bfloat16"):
        args = [
            "eval",
            "--weights",
            str(tiny_weights),
            "--adapter",
            str(out),
            "--val",
            f"colours={image_folder}",
        ]
        args += ["--device", "cpu", "--precision", precision, "--json"]
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
        (report,) = json.loads(result.output)
        assert report["unchanged"] is True and report["images"] == 48
        scores[precision] = report["top1"]
    assert abs(scores["bfloat16"] - scores["float32"]) <= 2 / 48  # two images at most


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_a_cuda_device_on_a_machine_without_one_is_one_clear_line(
    tmp_path, tiny_weights, image_folder
) -> None:
    result = _train(tiny_weights, image_folder, tmp_path / "x.safetensors", "--device", "cuda")
    assert result.exit_code == 2
    assert "device 'cuda' asked for, this machine has no CUDA device" in result.output
    args = ["eval", "--weights", str(tiny_weights), "--val", f"base={image_folder}", "--device", "cuda"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and "no CUDA device" in result.output
    result = _train(tiny_weights, image_folder, tmp_path / "x.safetensors", "--precision", "float16")
    assert result.exit_code == 2 and "precision must be one of float32, bfloat16" in result.output
