"""Activation caches: the class-token path from a cache equals the uncached split path (logits and
gradients, every base variant, both stores), training from a cache equals training from the images,
and a cache refuses clearly whatever it was not built for."""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import shutil
from collections import namedtuple

import numpy as np
import pytest
import torch

import memvit.adapters.training.batches as batches_module
import memvit.adapters.training.cache as cache_module
from memvit.adapters.preprocess import eval_transform
from memvit.adapters.training import TrainConfig, TrainingRun, scan_folder, train_adapters
from memvit.adapters.training.cache import ActivationCache
from memvit.adapters.training.cache_key import CacheError, CacheSpec
from memvit.adapters.training.cache_stream import CachedStream, view_choices
from memvit.memory_core import AdapterSet, MemoryViT
from memvit.memory_core.stored.cached import STORES, CachedBatch, capture
from tests.conftest import TOL, VARIANTS, images, make_folder, max_diff, random_adapter, tiny_engine


def _trainable(engine: MemoryViT, name: str, m: int, seed: int, norm: str = "norm1"):
    weights = random_adapter(name, engine, m=m, seed=seed, memory_norm=norm)
    tensors = {k: getattr(weights, k).clone().requires_grad_() for k in ("memory", "cls_token")}
    tensors |= {k: getattr(weights, k).clone().requires_grad_() for k in ("head_weight", "head_bias")}
    return dataclasses.replace(weights, **tensors)


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cached_logits_and_gradients_equal_the_split_path(variant: str, store: str) -> None:
    engine = tiny_engine(variant)
    x = images(engine, batch=4)
    base_logits, layers = capture(engine, x, store)
    grads = []
    for source in ("split", "cached"):
        adapters = [_trainable(engine, "a", 2, 0), _trainable(engine, "b", 0, 1, "none")]
        adapter_set = AdapterSet(tuple(engine.prepare(w) for w in adapters))
        if source == "split":
            out = engine(x, adapter_set, path="split")
        else:
            out = engine(CachedBatch(store, layers, base_logits), adapter_set)
        weights = torch.linspace(-1, 1, 5)
        sum((out.adapters[n] * weights).sum() for n in ("a", "b")).backward()
        grads.append({(w.name, k): getattr(w, k).grad for w in adapters for k in ("memory", "cls_token")})
        grads[-1] |= {(w.name, "head"): w.head_weight.grad for w in adapters}
        if source == "split":
            expected = out
    assert max_diff(out.base, expected.base) <= TOL
    for name in ("a", "b"):
        assert max_diff(out.adapters[name], expected.adapters[name]) <= TOL, name
    split, cached = grads
    assert split[("b", "memory")] is None and cached[("b", "memory")] is None  # m = 0: nothing to learn
    for key, grad in split.items():
        if key != ("b", "memory"):
            assert max_diff(cached[key], grad) <= TOL, key


@pytest.mark.parametrize("dtype, bound", [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_narrow_storage_rounds_a_little(dtype: torch.dtype, bound: float) -> None:
    engine = tiny_engine()
    x = images(engine, batch=4)
    adapter_set = engine.prepare_set([random_adapter("a", engine, m=2)])
    expected = engine(x, adapter_set).adapters["a"]
    base_logits, layers = capture(engine, x, "inputs")
    narrow = engine(CachedBatch("inputs", layers.to(dtype), base_logits), adapter_set).adapters["a"]
    assert 0 < max_diff(narrow, expected) <= bound


@pytest.fixture
def folder(tmp_path):
    return make_folder(tmp_path / "images", per_class=4)


def _open(engine, folder, directory, **spec) -> ActivationCache:
    samples = scan_folder(folder)
    return ActivationCache.open_or_build(CacheSpec(directory, **spec), engine, samples, progress=False)


def test_a_cache_holds_what_the_base_computes_per_view(tmp_path, folder) -> None:
    engine = tiny_engine()
    cache = _open(engine, folder, tmp_path / "c", dtype="float32", views=2)
    assert len(cache) == 12 and cache.views == ("original", "hflip")
    samples = scan_folder(folder)
    transform = eval_transform(engine)
    from memvit.adapters.training.data import load_image

    x = torch.stack([transform(load_image(samples.paths[i])) for i in (0, 5)])
    for view, flipped in ((0, x), (1, x.flip(-1))):
        base_logits, layers = capture(engine, flipped, "inputs")
        batch = cache.batch([0, 5], [view, view])
        assert max_diff(batch.layers, layers) <= TOL and max_diff(batch.base_logits, base_logits) <= TOL
    # Reopening reuses it: nothing rebuilt.
    stamp = (cache.directory / "activations.bin").stat().st_mtime_ns
    assert _open(engine, folder, tmp_path / "c", dtype="float32", views=2).key == cache.key
    assert (cache.directory / "activations.bin").stat().st_mtime_ns == stamp


def test_only_rows_not_in_memory_get_a_read_ahead_hint(tmp_path, folder, monkeypatch) -> None:
    cache = _open(tiny_engine(), folder, tmp_path / "c", dtype="float32", views=2)
    hints = []
    monkeypatch.setattr(ActivationCache, "_hint", lambda self, offset, length: hints.append((offset, length)))
    np.asarray(cache.activations).reshape(-1).view(np.uint8)[:: mmap.PAGESIZE].sum()  # every page read
    cache.batch([0, 5, 7], [0, 1, 0])
    assert hints == []  # all in memory: no system call per row
    monkeypatch.setattr(cache_module, "all_resident", lambda address, length: False)  # as if dropped
    cache.batch([0, 5, 7], [0, 1, 0])
    row = cache._row_bytes
    starts = [(image * 2 + view) * row for image, view in ((0, 0), (5, 1), (7, 0))]
    assert [o for o, _ in hints] == [s - s % mmap.PAGESIZE for s in starts]
    assert all(o + n >= s + row for (o, n), s in zip(hints, starts, strict=True))  # each whole row


def test_a_cache_refuses_another_base_preprocessing_images_or_setting(tmp_path, folder) -> None:
    directory = tmp_path / "c"
    _open(tiny_engine(), folder, directory, views=1)
    with pytest.raises(CacheError, match="the base weights") as refused:
        _open(tiny_engine(seed=1), folder, directory, views=1)
    assert "--rebuild-cache" in str(refused.value)
    other_crop = tiny_engine()
    other_crop._data_config_overrides["crop_pct"] = 1.0
    with pytest.raises(CacheError, match=r"the preprocessing \(crop_pct: 0.9 -> 1.0\)"):
        _open(other_crop, folder, directory, views=1)
    with pytest.raises(CacheError, match=r"the views"):
        _open(tiny_engine(), folder, directory, views=2)
    with pytest.raises(CacheError, match=r"the storage dtype \(cached float16, asked float32\)"):
        _open(tiny_engine(), folder, directory, views=1, dtype="float32")
    changed = sorted((folder / "red").iterdir())[0]
    os.utime(changed, ns=(0, 0))
    with pytest.raises(CacheError, match=r"the images \(12 cached, 12 now; 1 changed, e.g. red/000.png\)"):
        _open(tiny_engine(), folder, directory, views=1)
    shutil.copy(changed, folder / "red" / "extra.png")
    with pytest.raises(CacheError, match=r"1 added, e.g. red/extra.png"):
        _open(tiny_engine(), folder, directory, views=1)
    rebuilt = _open(tiny_engine(), folder, directory, views=1, rebuild=True)
    assert len(rebuilt) == 13


def test_a_cache_checks_free_disk_space_before_writing(tmp_path, folder, monkeypatch) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(cache_module.shutil, "disk_usage", lambda path: usage(10**9, 10**9, 10**6))
    with pytest.raises(CacheError, match=r"needs 0.00 GB \(.* bytes per image\), only 0.00 GB free"):
        _open(tiny_engine(), folder, tmp_path / "c")
    assert not (tmp_path / "c").exists() and not (tmp_path / ".c.building").exists()


def test_a_half_built_cache_is_never_used(tmp_path, folder, monkeypatch) -> None:
    directory = tmp_path / "c"

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cache_module, "capture", killed)
    with pytest.raises(KeyboardInterrupt):
        _open(tiny_engine(), folder, directory)
    assert not directory.exists()  # the partial build stays in the temp directory
    monkeypatch.undo()
    assert len(_open(tiny_engine(), folder, directory)) == 12  # built afresh over the leftovers
    assert not (tmp_path / ".c.building").exists()
    # A directory that is not a whole cache (no manifest) is refused, not read.
    (directory / "manifest.json").unlink()
    with pytest.raises(CacheError, match="not a complete activation cache"):
        _open(tiny_engine(), folder, directory)
    assert len(_open(tiny_engine(), folder, directory, rebuild=True)) == 12
    # A rebuild never deletes a directory that is not a cache.
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(CacheError, match="not an activation cache: not replacing it"):
        _open(tiny_engine(), folder, tmp_path / "mine", rebuild=True)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def test_views_are_drawn_per_sample_and_epoch_from_the_seed(tmp_path, folder) -> None:
    assert (view_choices(0, 3, 1000, 2, 0.5) == view_choices(0, 3, 1000, 2, 0.5)).all()
    assert (view_choices(0, 3, 1000, 2, 0.5) != view_choices(0, 4, 1000, 2, 0.5)).any()
    assert 400 < view_choices(0, 3, 1000, 2, 0.5).sum() < 600
    assert view_choices(0, 3, 1000, 2, 0.0).sum() == 0 and view_choices(0, 3, 1000, 1, 0.5).sum() == 0
    cache = _open(tiny_engine(), folder, tmp_path / "c", views=2)
    samples = scan_folder(folder)
    stream = CachedStream(cache, samples, batch_size=5, seed=0, draws=24, start=0, hflip=0.5)
    batches = list(stream)
    assert [len(b) for b, _ in batches] == [5, 5, 5, 5, 4]
    resumed = list(CachedStream(cache, samples, batch_size=5, seed=0, draws=24, start=15, hflip=0.5))
    for (a, la), (b, lb) in zip(batches[3:], resumed, strict=True):
        assert torch.equal(a.layers, b.layers) and torch.equal(la, lb)


def _run_configs(folder, **overrides) -> list[TrainConfig]:
    common = dict(train_dir=str(folder), val_fraction=0.25, steps=5, batch_size=4, lr=0.1, seed=3, hflip=0.0)
    common |= overrides
    return [
        TrainConfig(name="m2", memory_tokens=2, **common),
        TrainConfig(name="tok", memory_tokens=0, memory_init="normal", **common),
    ]


def test_training_from_the_cache_equals_training_from_the_images(
    tmp_path, image_folder, tiny_weights, monkeypatch
) -> None:
    def engine():
        return MemoryViT.from_timm(weights=str(tiny_weights))

    cached = train_adapters(
        engine(),
        _run_configs(image_folder, cache=str(tmp_path / "cache"), cache_dtype="float32", cache_views=1),
        progress=False,
    )
    # From the images with the cache's (deterministic) preprocessing instead of random crops.
    monkeypatch.setattr(batches_module, "train_transform", lambda engine, **kw: eval_transform(engine))
    uncached = train_adapters(engine(), _run_configs(image_folder), progress=False)
    for a, b in zip(cached, uncached, strict=True):
        assert a.losses == pytest.approx(b.losses, abs=TOL)
        for key, tensor in b.bundle.tensors().items():
            assert not tensor.numel() or max_diff(a.bundle.tensors()[key], tensor) <= TOL, key
        assert a.val == b.val
        assert a.augmentation == "cached views: original, centre crop"
        assert a.bundle.training["augmentation"] == a.augmentation
        assert a.bundle.training["cache"]["dtype"] == "float32"
        assert b.bundle.training["augmentation"].endswith("(uncached)") and b.bundle.training["cache"] is None


def test_a_cached_run_resumes_exactly(tmp_path, image_folder, tiny_weights) -> None:
    configs = _run_configs(image_folder, cache=str(tmp_path / "cache"), hflip=0.5)
    straight = train_adapters(MemoryViT.from_timm(weights=str(tiny_weights)), configs, progress=False)
    ckpt = tmp_path / "run.ckpt"
    stopped = TrainingRun(
        MemoryViT.from_timm(weights=str(tiny_weights)), configs, checkpoint=ckpt, progress=False
    )
    stopped.run(until=2)
    stopped.save_checkpoint()
    resumed = train_adapters(
        MemoryViT.from_timm(weights=str(tiny_weights)), configs, checkpoint=ckpt, resume=True, progress=False
    )
    for a, b in zip(resumed, straight, strict=True):
        assert a.losses == pytest.approx(b.losses, abs=1e-6)
        assert a.augmentation == "cached views: original+hflip (mirror with p=0.5), centre crop"
    manifest = json.loads((tmp_path / "cache" / "train" / "manifest.json").read_text())
    assert manifest["key"]["views"] == ["original", "hflip"] and manifest["key"]["dtype"] == "float16"


def test_the_folded_attention_is_the_attention_over_keys_and_values_in_float64() -> None:
    # The "inputs" store never forms the base keys: its scores, softmax and weighted sum, and their
    # hand-written backward pass, against autograd through the keys and values projected from h.
    from memvit.memory_core.block.attention import KeysValues, project_qkv
    from memvit.memory_core.stored.cached import NormedInputs

    # Narrow (width 16, two heads of 8): gradcheck perturbs each element of q, so a quarter the cost.
    engine = tiny_engine(embed_dim=16, num_heads=2).double()
    attn = engine.base.blocks[0].attn
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 5, 16, generator=g, dtype=torch.float64)
    q = torch.randn(2, 2, 3, 8, generator=g, dtype=torch.float64, requires_grad=True)
    other = torch.randn(2, 2, 3, 2, generator=g, dtype=torch.float64, requires_grad=True)
    _, k, v = project_qkv(attn, h)
    for a, b in zip(
        NormedInputs(h).attend(attn, q, other), KeysValues(k, v).attend(attn, q, other), strict=True
    ):
        assert max_diff(a, b) <= 1e-12
    assert torch.autograd.gradcheck(lambda q, o: NormedInputs(h).attend(attn, q, o), (q, other))
