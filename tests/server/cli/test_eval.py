"""``memvit eval`` (server/cli/evaluate.py)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memvit.server.cli import app
from tests.conftest import IMAGENET_LABELS, make_folder

runner = CliRunner()


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
    from memvit.memory_core import save_base
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
