"""Where a run reads its activation cache (adapters/training/cache_placement.py): every placement
gives the same batches bit for bit, auto chooses by size, and the cache knows its base pass's precision."""

from __future__ import annotations

import pytest
import torch

import memvit.adapters.training.cache_placement as placement_module
from memvit.adapters.training import TrainConfig, TrainingError, scan_folder, train_adapters
from memvit.adapters.training.cache import ActivationCache
from memvit.adapters.training.cache_key import CacheError, CacheSpec
from memvit.adapters.training.cache_placement import PlacedCache, choose
from memvit.adapters.training.cache_stream import CachedStream, in_order
from memvit.memory_core import MemoryViT
from tests.conftest import make_folder, tiny_engine

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("placement") / "images", per_class=4)


def _cache(engine, folder, directory, **spec) -> ActivationCache:
    return ActivationCache.open_or_build(
        CacheSpec(directory, **spec), engine, scan_folder(folder), progress=False
    )


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_device_memory_and_disk_give_the_same_batches(tmp_path, folder, dtype) -> None:
    cache = _cache(tiny_engine(), folder, tmp_path / "c", dtype=dtype, views=2)
    disk, device = PlacedCache(cache, "disk", CPU), PlacedCache(cache, "device", CPU)
    assert (disk.placement, device.placement) == ("disk", "device")
    assert len(device) == len(cache) and device.views == cache.views and device.describe() == cache.describe()
    assert device.directory == cache.directory and device.activations is cache.activations
    rows, views = [7, 0, 11, 7], [1, 0, 0, 0]
    for placed in (disk, device):
        batch = placed.batch(rows, views)
        expected = cache.batch(rows, views)
        assert batch.layers.dtype == expected.layers.dtype == getattr(torch, dtype)
        assert torch.equal(batch.layers, expected.layers) and torch.equal(
            batch.base_logits, expected.base_logits
        )
    samples = scan_folder(folder)
    streams = [
        list(CachedStream(p, samples, batch_size=5, seed=1, draws=30, hflip=0.5)) for p in (disk, device)
    ]
    for (a, la), (b, lb) in zip(*streams, strict=True):
        assert torch.equal(a.layers, b.layers) and torch.equal(la, lb)
    for (a, _), (b, _) in zip(in_order(disk, samples, 5), in_order(device, samples, 5), strict=True):
        assert torch.equal(a.layers, b.layers)


def test_auto_chooses_by_size_and_pinned_needs_cuda(monkeypatch) -> None:
    assert choose("auto", 1, CPU) == "disk"  # the page cache is the CPU's memory tier
    assert choose("device", 1, CPU) == "device"
    with pytest.raises(CacheError, match="needs a CUDA device"):
        choose("pinned", 1, CPU)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1000, 4000))  # 1,000 bytes free
    monkeypatch.setattr(placement_module, "available_host_bytes", lambda: 10_000)
    assert choose("auto", 500, cuda) == "device"  # half the free device memory
    assert choose("auto", 501, cuda) == "pinned"
    assert choose("auto", 5_000, cuda) == "pinned"  # half the available host memory
    assert choose("auto", 5_001, cuda) == "disk"
    monkeypatch.setattr(placement_module, "available_host_bytes", lambda: None)
    assert choose("auto", 501, cuda) == "disk"
    assert choose("disk", 1, cuda) == "disk"


def test_training_reads_the_same_from_device_memory_and_from_disk(tmp_path, image_folder, tiny_weights):
    def run(placement: str):
        config = TrainConfig(
            name="placed",
            train_dir=str(image_folder),
            val_fraction=0.25,
            steps=4,
            batch_size=4,
            seed=2,
            cache=str(tmp_path / "cache"),
            cache_placement=placement,
        )
        return train_adapters(MemoryViT.from_timm(weights=str(tiny_weights)), [config], progress=False)[0]

    disk, device = run("disk"), run("device")
    assert disk.losses == device.losses and disk.val == device.val
    assert torch.equal(disk.bundle.weights.memory, device.bundle.weights.memory)
    with pytest.raises(TrainingError, match="cache placement must be one of"):
        TrainConfig(name="x", train_dir="-", cache_placement="gpu")


def test_a_cache_built_in_another_precision_is_refused(tmp_path, folder) -> None:
    engine = tiny_engine()
    _cache(engine, folder, tmp_path / "c", views=1)
    with pytest.raises(
        CacheError, match=r"the precision of the base's pass \(cached float32, asked bfloat16\)"
    ):
        _cache(engine, folder, tmp_path / "c", views=1, precision="bfloat16")
    bf16 = _cache(engine, folder, tmp_path / "b", views=1, precision="bfloat16", dtype="float32")
    exact = _cache(engine, folder, tmp_path / "c32", views=1, dtype="float32")
    # The bfloat16 pass rounds: close to the float32 pass's activations, not equal to them.
    a, b = bf16.batch(list(range(12))).layers, exact.batch(list(range(12))).layers
    assert not torch.equal(a, b)
    assert (a - b).abs().max() <= 0.1 * b.abs().max()
    with pytest.raises(CacheError, match=r"cached bfloat16, asked float32"):
        _cache(engine, folder, tmp_path / "b", views=1, dtype="float32")


def test_a_bfloat16_cache_holds_the_bfloat16_base_pass_and_refuses_the_autocast_ones(
    tmp_path, folder
) -> None:
    """A bfloat16 cache is what the bfloat16 base pass computes (the base held in bfloat16, as the
    training step's base rows and bfloat16 evaluation run it: base_pass.py); one built before, under
    autocast over the float32 weights, holds other numbers and is refused."""
    import json

    from memvit.adapters.preprocess import eval_transform
    from memvit.adapters.training.base_pass import BasePass
    from memvit.adapters.training.data import ImageDataset

    engine = tiny_engine()
    cache = _cache(engine, folder, tmp_path / "b", views=1, precision="bfloat16", dtype="bfloat16")
    dataset = ImageDataset(scan_folder(folder), eval_transform(engine))
    x = torch.stack([dataset[i][0] for i in range(len(dataset))])
    assert torch.equal(cache.batch(list(range(len(dataset)))).layers, BasePass(engine, "bfloat16")(x).layers)
    manifest_path = tmp_path / "b" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["key"]["base"]  # what a cache built under autocast recorded
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(
        CacheError, match=r"how that pass held the base \(cached None, asked held in bfloat16, norms too\)"
    ):
        _cache(engine, folder, tmp_path / "b", views=1, precision="bfloat16", dtype="bfloat16")
