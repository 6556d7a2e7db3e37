"""Many adapters in one training run: each ends exactly where it would have ended trained alone, and
a sweep from the command line writes every bundle, the chosen one and a report."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from memvit.adapters import read_bundle
from memvit.adapters.training import TrainConfig, TrainingError, TrainingRun, train_adapter, train_adapters
from memvit.adapters.training.sweep import expand, parse_sweep
from memvit.adapters.training.variant import Variant
from memvit.memory_core import MemoryViT
from memvit.server.cli import app
from tests.conftest import max_diff, tiny_engine

TOL = 2e-5  # float32: one pass with 8 rows against one with 1 rounds a little differently


def _engine(tiny_weights) -> MemoryViT:
    return MemoryViT.from_timm(weights=str(tiny_weights))


def _config(folder, **overrides) -> TrainConfig:
    base = dict(name="colours", train_dir=str(folder), val_fraction=0.25, steps=4, batch_size=8, seed=0)
    return TrainConfig(**{**base, **overrides})


def _assert_same(together, alone) -> None:
    assert together.losses == pytest.approx(alone.losses, abs=TOL)
    for key, tensor in alone.bundle.tensors().items():
        assert together.bundle.tensors()[key].shape == tensor.shape, key
        if tensor.numel():
            assert max_diff(together.bundle.tensors()[key], tensor) <= TOL, key
    assert together.val == alone.val


def test_eight_variants_in_one_run_equal_each_trained_alone(image_folder, tiny_weights) -> None:
    sweep = parse_sweep(["lr=0.05,0.3", "token-lr-scale=1,30", "memory-tokens=0,2"])
    variants = expand(_config(image_folder), sweep)
    assert len(variants) == 8
    configs = [c for c, _ in variants]
    together = train_adapters(_engine(tiny_weights), configs, progress=False)
    # The variants really differ (a shared optimiser or a mixed-up gradient would blur them).
    heads = {round(float(r.bundle.weights.head_weight.abs().sum()), 4) for r in together}
    assert len(heads) == 8
    for config, result in zip(configs, together, strict=True):
        _assert_same(result, train_adapter(_engine(tiny_weights), config, progress=False))


def test_regimes_norms_and_schedules_mix_in_one_run(image_folder, tiny_weights) -> None:
    configs = [
        _config(image_folder, name="head", head_only=True, lr=0.2),
        _config(image_folder, name="token", memory_tokens=0, token_lr_scale=30),
        _config(image_folder, name="mem", memory_tokens=3, memory_lr_scale=5, warmup_fraction=0.5),
        _config(image_folder, name="raw", memory_tokens=1, memory_norm="none", momentum=0.5, clip_grad=0.1),
        _config(image_folder, name="drawn", memory_tokens=2, memory_init="tokens"),
    ]
    together = train_adapters(_engine(tiny_weights), configs, progress=False, curve_points=2)
    for config, result in zip(configs, together, strict=True):
        _assert_same(result, train_adapter(_engine(tiny_weights), config, progress=False))
        assert [step for step, _ in result.curve] == [2, 4]


def test_extensions_of_one_parent_train_together(tmp_path, image_folder, tiny_weights) -> None:
    parent = tmp_path / "parent.safetensors"
    train_adapter(_engine(tiny_weights), _config(image_folder, name="parent"), out=parent, progress=False)
    configs = [
        _config(image_folder, name=f"child{i}", parent=str(parent), lr=lr, memory_tokens=1)
        for i, lr in enumerate((0.05, 0.2))
    ]
    together = train_adapters(_engine(tiny_weights), configs, progress=False)
    for config, result in zip(configs, together, strict=True):
        assert result.bundle.weights.parent == "parent"
        _assert_same(result, train_adapter(_engine(tiny_weights), config, progress=False))


def test_a_sweep_resumes_exactly(tmp_path, image_folder, tiny_weights) -> None:
    configs = [c for c, _ in expand(_config(image_folder, steps=6), parse_sweep(["lr=0.05,0.2"]))]
    straight = train_adapters(_engine(tiny_weights), configs, progress=False)
    ckpt = tmp_path / "sweep.ckpt"
    stopped = TrainingRun(_engine(tiny_weights), configs, checkpoint=ckpt, checkpoint_every=3, progress=False)
    stopped.run(until=3)
    assert stopped.steps == 3 and not stopped.finished and ckpt.is_file()
    resumed = train_adapters(_engine(tiny_weights), configs, checkpoint=ckpt, resume=True, progress=False)
    for a, b in zip(straight, resumed, strict=True):
        _assert_same(b, a)
    with pytest.raises(TrainingError, match="holds adapters"):
        train_adapters(_engine(tiny_weights), configs[:1], checkpoint=ckpt, resume=True, progress=False)


def test_adapters_trained_together_must_share_the_data(image_folder, tiny_weights) -> None:
    a, b = _config(image_folder, name="a"), _config(image_folder, name="b", batch_size=4)
    with pytest.raises(TrainingError, match="differ in batch_size"):
        train_adapters(_engine(tiny_weights), [a, b], progress=False)
    with pytest.raises(TrainingError, match="distinct names"):
        train_adapters(_engine(tiny_weights), [a, a], progress=False)


@pytest.mark.parametrize(
    "items,match",
    [
        (["batch-size=8,16"], "cannot sweep 'batch_size' \\(shared by every variant"),
        (["colour=1,2"], "cannot sweep 'colour'"),
        (["lr"], "expected FIELD=V1,V2"),
        (["lr=0.1,fast"], "'fast' is not a valid float"),
        (["memory-tokens=1,2.5"], "'2.5' is not a valid int"),
        (["lr=0.1,0.1"], "values repeat"),
        (["head-only=maybe"], "'maybe' is not a valid bool"),
    ],
)
def test_bad_sweeps_are_refused(items, match) -> None:
    with pytest.raises(TrainingError, match=match):
        parse_sweep(items)


def test_equal_variants_train_once_and_names_say_what_changed(image_folder) -> None:
    sweep = parse_sweep(["head-only=false,true", "memory-tokens=0,5", "memory-lr-scale=1,3"])
    variants = expand(_config(image_folder), sweep)
    names = [c.name for c, _ in variants]
    # Head-only forces memory 0, and memory's lr scale means nothing without memory: of the 8
    # combinations, 4 are different runs (head-only; m0; m5 with either scale).
    assert names == [
        "colours-head0-m0-mls1",
        "colours-head0-m5-mls1",
        "colours-head0-m5-mls3",
        "colours-head1-m0-mls1",
    ]
    assert len(set(names)) == len(names)


def test_sweep_from_the_cli_writes_bundles_chosen_and_report(tmp_path, image_folder, tiny_weights) -> None:
    out = tmp_path / "sweep"
    config = tmp_path / "run.toml"
    config.write_text('steps = 4\nbatch-size = 8\n[sweep]\nlr = [0.05, 0.3]\n"memory-tokens" = [0, 2]\n')
    args = ["train", "--name", "colours", "--train-dir", str(image_folder), "--weights", str(tiny_weights)]
    args += ["--config", str(config), "--sweep", "token-lr-scale=1,30", "--out", str(out), "--quiet"]
    args += ["--curve-points", "2"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "8 variants in one run" in result.output
    report = json.loads((out / "sweep.json").read_text())
    rows = report["variants"]
    assert len(rows) == 8 and sum(row["chosen"] for row in rows) == 1
    chosen = next(row for row in rows if row["chosen"])
    assert chosen["val_top1"] == max(row["val_top1"] for row in rows)
    assert all(len(row["curve"]) == 2 and row["steps"] == 4 for row in rows)
    for row in rows:  # every variant's bundle, with its own settings recorded
        bundle = read_bundle(out / row["bundle"])
        assert bundle.name == row["variant"]
        hyper = bundle.training["hyper_parameters"]
        assert {k: hyper[k] for k in row["overrides"]} == row["overrides"]
    best = read_bundle(out / "colours.safetensors")  # the chosen one under the run's name
    assert best.name == "colours" and best.training["sweep_variant"] == chosen["variant"]
    chosen_bundle = read_bundle(out / chosen["bundle"])
    for key, tensor in chosen_bundle.tensors().items():
        assert torch.equal(best.tensors()[key], tensor), key
    markdown = (out / "sweep.md").read_text()
    assert chosen["variant"] + " (chosen)" in markdown and "![learning curves](sweep.png)" in markdown
    with Image.open(out / "sweep.png") as png:
        assert png.format == "PNG" and png.size[0] > 600


def test_cli_refuses_a_sweep_of_shared_fields(tmp_path, image_folder, tiny_weights) -> None:
    args = ["train", "--name", "x", "--train-dir", str(image_folder), "--weights", str(tiny_weights)]
    result = CliRunner().invoke(app, [*args, "--sweep", "seed=0,1", "--quiet"])
    assert result.exit_code == 2
    assert "cannot sweep 'seed'" in result.output


def test_class_token_and_memory_have_their_own_lr_scales(image_folder) -> None:
    config = _config(image_folder, lr=0.1, token_lr_scale=30, memory_lr_scale=2)
    assert config.memory_lr == pytest.approx(0.2)
    config = dataclasses.replace(config, memory_tokens=2, memory_init="normal")
    variant = Variant(tiny_engine(), config, ("a", "b"), None, total=10)
    lrs = [group["initial_lr"] for group in variant.optimizer.param_groups]
    assert lrs == pytest.approx([0.1, 3.0, 0.2])  # head, class token, memory
