"""``--device`` and ``--precision`` (adapters/training/device.py), through the run's own code path on
the CPU: bfloat16 autocast trains, records its precision and writes the same float32 bundle format;
batches are timed; a device the machine lacks is refused before any data is read."""

from __future__ import annotations

import time

import pytest
import torch

from memvit.adapters import read_bundle
from memvit.adapters.training import TrainConfig, TrainingError, train_adapter, train_adapters
from memvit.adapters.training.base_pass import BasePass
from memvit.adapters.training.batches import Feed
from memvit.adapters.training.device import autocast, default_workers, resolve_device, to_device
from memvit.adapters.training.progress import Progress
from memvit.memory_core import MemoryViT
from memvit.memory_core.stored.cached import CachedBatch, capture
from tests.conftest import images, max_diff, tiny_engine

CPU = torch.device("cpu")


def _config(folder, **overrides) -> TrainConfig:
    base = dict(name="colours", train_dir=str(folder), val_fraction=0.25, memory_tokens=2, steps=24)
    return TrainConfig(**{**base, "batch_size": 8, "lr": 0.1, "seed": 0, **overrides})


def test_devices_resolve_or_are_refused() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == CPU
    for bad in ("gpu", "cuda:", "CPU", "cuda:x"):
        with pytest.raises(ValueError, match="device must be one of"):
            resolve_device(bad)
        with pytest.raises(TrainingError, match="device must be one of"):
            TrainConfig(name="x", train_dir="-", device=bad)
    with pytest.raises(TrainingError, match="precision must be one of"):
        TrainConfig(name="x", train_dir="-", precision="float16")
    missing = f"cuda:{torch.cuda.device_count()}"  # one past the last device, on any machine
    with pytest.raises(ValueError, match="this machine has"):
        resolve_device(missing)
    assert default_workers(CPU) == 0


def test_a_run_on_a_device_the_machine_lacks_is_refused_before_reading_data(tmp_path) -> None:
    missing = f"cuda:{torch.cuda.device_count()}"
    config = TrainConfig(name="x", train_dir=str(tmp_path / "absent"), device=missing)
    with pytest.raises(TrainingError, match="this machine has"):
        train_adapter(tiny_engine(), config, progress=False)


def test_the_base_pass_is_the_caches_pass_in_its_precision() -> None:
    engine = tiny_engine()
    x = images(engine, batch=4)
    batch = BasePass(engine)(x)
    logits, layers = capture(engine, x, "inputs")
    assert batch.store == "inputs" and torch.equal(batch.layers, layers)
    assert torch.equal(batch.base_logits, logits)
    bf16 = BasePass(engine, "bfloat16")(x)
    assert bf16.layers.dtype == torch.bfloat16  # autocast: the activations come out in bfloat16
    assert 0 < max_diff(bf16.layers, layers) <= 0.1 * layers.abs().max().item()
    with autocast(CPU, "float32"):
        assert (x[:1, 0, :2, :2] @ x[:1, 0, :2, :2]).dtype == torch.float32


def test_bfloat16_autocast_trains_like_float32_and_writes_the_same_format(
    tmp_path, image_folder, tiny_weights
) -> None:
    runs = {}
    for precision in ("float32", "bfloat16"):
        out = tmp_path / f"{precision}.safetensors"
        engine = MemoryViT.from_timm(weights=str(tiny_weights))
        config = _config(image_folder, precision=precision, device="cpu")
        runs[precision] = train_adapter(engine, config, out=out, progress=False)
        assert engine.dtype == torch.float32  # autocast: the engine's own weights are untouched
        bundle = read_bundle(out)
        assert all(t.dtype == torch.float32 for t in bundle.tensors().values())
        assert bundle.training["hyper_parameters"]["precision"] == precision
        assert bundle.training["device"] == "cpu"
        speed = bundle.training["speed"]
        assert speed["steps"] == 24 and speed["images_per_s"] > 0 and 0 <= speed["load_share"] <= 1
    fp32, bf16 = runs["float32"], runs["bfloat16"]
    # Zero heads: both start at exactly ln 3, then round differently and learn alike.
    assert bf16.losses[0] == fp32.losses[0]
    assert bf16.losses != fp32.losses
    assert bf16.losses[-1] == pytest.approx(fp32.losses[-1], abs=0.05)
    assert abs(bf16.val.top1 - fp32.val.top1) <= 1 / bf16.val.images + 1e-9  # at most one image of 12
    assert max_diff(bf16.bundle.weights.memory, fp32.bundle.weights.memory) < 0.05


def test_a_run_on_the_cpu_in_bfloat16_from_a_cache_resumes_under_the_same_precision_only(
    tmp_path, image_folder, tiny_weights
) -> None:
    config = _config(image_folder, precision="bfloat16", cache=str(tmp_path / "cache"), steps=4)
    train_adapters(MemoryViT.from_timm(weights=str(tiny_weights)), [config], progress=False)
    manifest = (tmp_path / "cache" / "train" / "manifest.json").read_text()
    assert '"precision": "bfloat16"' in manifest


def test_feed_moves_batches_and_times_the_wait() -> None:
    def slow():
        for i in range(3):
            time.sleep(0.02)
            yield torch.full((2, 3), float(i)), torch.tensor([i, i])

    feed = Feed(slow(), CPU)
    batches = list(feed)
    assert [b[1].tolist() for b in batches] == [[0, 0], [1, 1], [2, 2]]
    assert 0.05 <= feed.take_waited() < 1.0 and feed.take_waited() == 0.0
    cached = CachedBatch("inputs", torch.zeros(2, 1), torch.zeros(2, 3))
    assert to_device(cached, CPU) is cached  # already there: nothing copied


def test_progress_says_where_the_time_went() -> None:
    bar = Progress(10, 0, "x", enabled=False)
    for _ in range(4):
        time.sleep(0.01)
        bar.advance(images=8, waited=0.005)
    summary = bar.summary()
    assert summary["steps"] == 4 and 0.2 < summary["load_share"] < 0.7
    assert summary["images_per_s"] > 0 and summary["step_ms"] > 0
    bar.close()
