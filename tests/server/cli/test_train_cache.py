"""``memvit train --cache``, the sweep and ``memvit eval --cache``: built once, reused, refused when the
base changed, and every run says which augmentation it used."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memvit.adapters import read_bundle
from memvit.memory_core import save_base
from memvit.server.cli import app
from tests.conftest import TINY, make_folder, tiny_base
from tests.one_thread import one_torch_thread  # noqa: F401 (autouse, tests/one_thread.py)

runner = CliRunner()


@pytest.fixture
def image_folder(tmp_path):
    return make_folder(tmp_path / "images", per_class=6)


def _train(tmp_path, weights, folder, *extra: str):
    args = ["train", "--name", "colours", "--train-dir", str(folder), "--weights", str(weights)]
    args += ["--steps", "4", "--batch-size", "8", "--cache", str(tmp_path / "cache"), "--quiet"]
    if "--out" not in extra:  # never the working directory
        args += ["--out", str(tmp_path / "colours.safetensors")]
    return runner.invoke(app, args + list(extra))


def test_train_and_eval_from_a_cache(tmp_path, tiny_weights, image_folder) -> None:
    out = tmp_path / "colours.safetensors"
    result = _train(tmp_path, tiny_weights, image_folder, "--out", str(out), "--cache-dtype", "float32")
    assert result.exit_code == 0, result.output
    assert "augmentation: cached views: original+hflip (mirror with p=0.5), centre crop" in result.output
    assert (tmp_path / "cache" / "train" / "manifest.json").is_file()
    training = read_bundle(out).training
    assert training["cache"]["views"] == ["original", "hflip"]
    # The same command again reuses the cache; another storage dtype is refused, naming the fix.
    assert (
        _train(tmp_path, tiny_weights, image_folder, "--out", str(out), "--cache-dtype", "float32").exit_code
        == 0
    )
    refused = _train(tmp_path, tiny_weights, image_folder, "--out", str(out))
    assert refused.exit_code == 2
    assert "the storage dtype (cached float32, asked float16)" in refused.output
    assert "--rebuild-cache" in refused.output
    # Evaluation from a cache gives what evaluation from the images gives.
    evaluate = [
        "eval",
        "--weights",
        str(tiny_weights),
        "--adapter",
        str(out),
        "--val",
        f"colours={image_folder}",
    ]
    from_images = json.loads(runner.invoke(app, [*evaluate, "--json"]).output)
    cache = ["--cache", str(tmp_path / "eval-cache"), "--cache-dtype", "float32", "--json"]
    from_cache = runner.invoke(app, [*evaluate, *cache])
    assert from_cache.exit_code == 0, from_cache.output
    (a,), (b,) = json.loads(from_cache.output), from_images
    assert (a["top1"], a["top5"], a["unchanged"]) == (b["top1"], b["top5"], True)
    assert (tmp_path / "eval-cache" / "colours" / "manifest.json").is_file()


def test_a_cache_of_another_base_is_refused(tmp_path, tiny_weights, image_folder) -> None:
    assert _train(tmp_path, tiny_weights, image_folder, "--cache-views", "1").exit_code == 0
    other = save_base(
        tiny_base(seed=5).model,
        tmp_path / "other.safetensors",
        arch="vit_tiny_patch16_224",
        model_kwargs=TINY,
    )
    result = _train(tmp_path, other, image_folder, "--cache-views", "1")
    assert result.exit_code == 2 and "changed: the base weights" in result.output


def test_a_sweep_trains_from_the_cache_and_reports_its_augmentation(
    tmp_path, tiny_weights, image_folder
) -> None:
    out = tmp_path / "sweep"
    result = _train(tmp_path, tiny_weights, image_folder, "--sweep", "lr=0.05,0.2", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "augmentation: cached views" in result.output
    assert "Augmentation: cached views: original+hflip" in (out / "sweep.md").read_text()


def test_the_help_says_what_a_cache_does_to_augmentation() -> None:
    output = runner.invoke(app, ["train", "--help"], terminal_width=200).output
    help_text = " ".join(output.replace("│", " ").split())  # the words, out of rich's boxes
    assert "no random crops" in help_text and "--rebuild-cache" in help_text
