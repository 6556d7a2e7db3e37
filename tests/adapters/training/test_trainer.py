"""Training learns, writes a bundle that serves, resumes exactly, and refuses bad folders clearly."""

from __future__ import annotations

import math

import pytest
import torch

from memvit.adapters import attach_bundle, read_bundle
from memvit.adapters.training import DataError, TrainConfig, TrainingError, TrainingRun, train_adapter
from memvit.memory_core import LiveAdapters, MemoryViT
from tests.conftest import make_folder, max_diff


def _engine(tiny_weights) -> MemoryViT:
    return MemoryViT.from_timm(weights=str(tiny_weights))


def _config(folder, **overrides) -> TrainConfig:
    base = dict(
        name="colours",
        train_dir=str(folder),
        val_fraction=0.25,
        memory_tokens=2,
        steps=40,
        batch_size=8,
        lr=0.1,
        seed=0,
    )
    return TrainConfig(**{**base, **overrides})


def test_training_learns_and_the_bundle_serves(tmp_path, image_folder, tiny_weights) -> None:
    engine = _engine(tiny_weights)
    out = tmp_path / "colours.safetensors"
    result = train_adapter(engine, _config(image_folder), out=out, progress=False)
    # A zero-initialised head predicts uniformly at first: the first loss is exactly ln 3.
    assert result.losses[0] == pytest.approx(math.log(3), rel=1e-5)
    assert sum(result.losses[-5:]) / 5 < 0.5 * math.log(3)
    assert result.val.top1 > 0.6  # chance is 1/3
    bundle = read_bundle(out)
    training = bundle.training
    assert training["steps"] == 40 and training["regime"] == "memory"
    assert training["val_accuracy"]["top1"] == result.val.top1
    assert training["data"]["classes"] == ["blue", "green", "red"]
    assert training["hyper_parameters"]["lr"] == 0.1
    assert bundle.labels == ("blue", "green", "red")
    # The written bundle serves on a fresh engine and gives the accuracy training reported.
    served = LiveAdapters(_engine(tiny_weights))
    attach_bundle(served, out)
    assert served.current.names == ("colours",)


def test_same_seed_same_adapter(image_folder, tiny_weights) -> None:
    a = train_adapter(_engine(tiny_weights), _config(image_folder, steps=6), progress=False)
    b = train_adapter(_engine(tiny_weights), _config(image_folder, steps=6), progress=False)
    assert max_diff(a.bundle.weights.memory, b.bundle.weights.memory) == 0.0
    assert a.losses == b.losses


def test_resume_continues_exactly(tmp_path, image_folder, tiny_weights) -> None:
    config = _config(image_folder, steps=8)
    straight = train_adapter(_engine(tiny_weights), config, progress=False)
    ckpt = tmp_path / "run.ckpt"
    engine = _engine(tiny_weights)
    stopped = TrainingRun(engine, [config], checkpoint=ckpt, checkpoint_every=2, progress=False)
    stopped.run(until=4)  # the checkpoint falls due at step 4
    assert stopped.steps == 4 and not stopped.finished and ckpt.is_file()
    with pytest.raises(TrainingError, match="at step 4 of 8"):
        stopped.finish()
    resumed = train_adapter(_engine(tiny_weights), config, checkpoint=ckpt, resume=True, progress=False)
    assert resumed.steps == 8
    assert resumed.losses == pytest.approx(straight.losses, abs=1e-6)
    for key, tensor in straight.bundle.tensors().items():
        assert max_diff(resumed.bundle.tensors()[key], tensor) <= 1e-6, key


def test_a_run_steps_saves_and_resumes_anywhere(tmp_path, image_folder, tiny_weights) -> None:
    # Step by step, in pieces, with a checkpoint saved off the schedule and resumed in a fresh
    # process's stead: the same run as one straight through.
    config = _config(image_folder, steps=7)
    straight = train_adapter(_engine(tiny_weights), config, progress=False)
    ckpt = tmp_path / "run.ckpt"
    run = TrainingRun(_engine(tiny_weights), [config], checkpoint=ckpt, checkpoint_every=100, progress=False)
    run.step()
    run.run(until=3)
    assert run.steps == 3 and not ckpt.exists()  # none due yet
    run.save_checkpoint()
    at_3 = tmp_path / "at-3.ckpt"
    at_3.write_bytes(ckpt.read_bytes())  # the run writes its checkpoint again at the end
    run.run(until=5)
    run.run()
    assert run.finished
    with pytest.raises(TrainingError, match="finished"):
        run.step()
    (in_pieces,) = run.finish()
    resumed_run = TrainingRun(_engine(tiny_weights), [config], checkpoint=at_3, progress=False)
    resumed_run.resume()
    assert resumed_run.steps == 3
    resumed_run.run()
    (resumed,) = resumed_run.finish()
    with pytest.raises(TrainingError, match="before the first step"):
        resumed_run.resume()
    for result in (in_pieces, resumed):
        assert result.steps == 7
        assert result.losses == pytest.approx(straight.losses, abs=1e-6)
        for key, tensor in straight.bundle.tensors().items():
            assert max_diff(result.bundle.tensors()[key], tensor) <= 1e-6, key
        assert result.val == straight.val


def test_resume_refuses_other_settings(tmp_path, image_folder, tiny_weights) -> None:
    ckpt = tmp_path / "run.ckpt"
    config = _config(image_folder, steps=4)
    run = TrainingRun(_engine(tiny_weights), [config], checkpoint=ckpt, checkpoint_every=2, progress=False)
    run.run(until=2)
    with pytest.raises(TrainingError, match=r"different settings \(lr\)"):
        train_adapter(
            _engine(tiny_weights),
            _config(image_folder, steps=4, lr=0.5),
            checkpoint=ckpt,
            resume=True,
            progress=False,
        )
    with pytest.raises(TrainingError, match="nothing to resume"):
        train_adapter(
            _engine(tiny_weights),
            _config(image_folder),
            checkpoint=tmp_path / "none.ckpt",
            resume=True,
            progress=False,
        )


def test_regimes_train_only_their_parameters(image_folder, tiny_weights) -> None:
    engine = _engine(tiny_weights)
    base_cls = engine.base.cls_token.detach().reshape(-1)
    head = train_adapter(engine, _config(image_folder, head_only=True, steps=5), progress=False)
    assert head.bundle.weights.num_memory == 0
    assert torch.equal(head.bundle.weights.cls_token, base_cls)
    assert head.bundle.training["regime"] == "head-only"
    token = train_adapter(engine, _config(image_folder, memory_tokens=0, steps=5), progress=False)
    assert token.bundle.weights.num_memory == 0
    assert not torch.equal(token.bundle.weights.cls_token, base_cls)
    assert token.bundle.training["regime"] == "class-token"


def test_extension_mode_trains_on_top_of_a_parent(tmp_path, image_folder, tiny_weights) -> None:
    engine = _engine(tiny_weights)
    parent_path = tmp_path / "parent.safetensors"
    train_adapter(engine, _config(image_folder, name="parent", steps=5), out=parent_path, progress=False)
    child = train_adapter(
        engine, _config(image_folder, name="child", steps=5, parent=str(parent_path)), progress=False
    )
    assert child.bundle.weights.parent == "parent"
    live = LiveAdapters(engine)
    attach_bundle(live, parent_path)
    attach_bundle(live, child.bundle)
    assert live.current.lineage("child") == ["child", "parent"]


def test_bad_folders_get_clear_errors(tmp_path, tiny_weights) -> None:
    engine = _engine(tiny_weights)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="has no class folders"):
        train_adapter(engine, _config(empty), progress=False)
    with pytest.raises(DataError, match="image folder not found"):
        train_adapter(engine, _config(tmp_path / "missing"), progress=False)
    one = make_folder(tmp_path / "one", per_class=3)
    for name in ("green", "blue"):
        for f in (one / name).iterdir():
            f.unlink()
        (one / name).rmdir()
    with pytest.raises(DataError, match=r"only one class \('red'\)"):
        train_adapter(engine, _config(one), progress=False)
    broken = make_folder(tmp_path / "broken", per_class=3)
    (broken / "red" / "oops.png").write_bytes(b"definitely not a png")
    with pytest.raises(DataError, match=r"1 unreadable image\(s\): .*oops\.png"):
        train_adapter(engine, _config(broken), progress=False)
    hollow = make_folder(tmp_path / "hollow", per_class=3)
    (hollow / "purple").mkdir()
    with pytest.raises(DataError, match="purple has no images"):
        train_adapter(engine, _config(hollow), progress=False)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(name="Bad Name"), "invalid name"),
        (dict(memory_norm="post"), "memory_norm must be one of"),
        (dict(memory_tokens=-1), "memory tokens must be >= 0"),
        (dict(lr=0.0), "need lr > 0"),
    ],
)
def test_bad_settings_are_refused(overrides, match, image_folder) -> None:
    with pytest.raises(TrainingError, match=match):
        _config(image_folder, **overrides)


def test_gradient_clipping_bounds_every_step(image_folder, tiny_weights) -> None:
    # With the gradient norm clipped to 1e-8, SGD (lr 0.1, momentum 0.9) moves no parameter by more
    # than lr * clip * (1 + 0.9 + 0.81) over 3 steps; unclipped, the head alone moves by far more.
    clipped = train_adapter(
        _engine(tiny_weights), _config(image_folder, steps=3, clip_grad=1e-8), progress=False
    )
    assert clipped.bundle.weights.head_weight.abs().max() < 0.1 * 1e-8 * 2.71 + 1e-12
    free = train_adapter(_engine(tiny_weights), _config(image_folder, steps=3, clip_grad=1e3), progress=False)
    assert free.bundle.weights.head_weight.abs().max() > 1e-4
