"""Bundles: exact round trip, and every bad bundle refused by name with the live set unchanged."""

from __future__ import annotations

import io
import json
import pickle
import re
from collections.abc import Callable

import pytest
import torch
from safetensors.torch import save

from memvit.adapters import (
    FORMAT,
    BaseMismatchError,
    BundleFormatError,
    BundleMetadataError,
    BundleTensorError,
    attach_bundle,
    bundle_for,
    read_bundle,
    save_bundle,
)
from memvit.memory_core import AdapterError, DuplicateAdapterError, LiveAdapters, MissingParentError
from tests.conftest import SHARED_DATA, images, max_diff, random_adapter


@pytest.fixture
def loaded(engine):
    """An engine with two adapters live, and a valid third bundle to corrupt."""
    live = LiveAdapters(engine)
    live.replace_all([random_adapter("first", engine, m=2), random_adapter("second", engine, m=0)])
    good = bundle_for(random_adapter("new", engine, m=3, classes=5), engine, training={"steps": 10})
    return live, good


def test_round_trip_is_exact(tmp_path, loaded) -> None:
    live, bundle = loaded
    engine = live.engine
    path = save_bundle(bundle, tmp_path / "new.safetensors")
    back = read_bundle(path)
    for key, tensor in bundle.tensors().items():
        assert torch.equal(back.tensors()[key], tensor), key
    assert back.metadata() == bundle.metadata()
    assert back.describe() == bundle.describe()
    assert back.training == {"steps": 10}
    attach_bundle(live, path)
    x = images(engine)
    served = engine(x, live.current).adapters["new"]
    live.add(bundle.weights, replace=True)
    assert max_diff(engine(x, live.current).adapters["new"], served) == 0.0


def _rebuild(bundle, tensors: Callable | None = None, meta: Callable | None = None) -> bytes:
    t = bundle.tensors()
    m = bundle.metadata()
    if tensors:
        tensors(t)
    if meta:
        meta(m)
    return save(t, metadata=m)


def _set(key, value):
    def edit(d):
        d[key] = value

    return edit


def _drop(key):
    return lambda d: d.pop(key)


BAD = {
    "missing tensor": (
        lambda b: _rebuild(b, tensors=_drop("cls_token")),
        BundleTensorError,
        "missing tensor 'cls_token'",
    ),
    "unexpected tensor": (
        lambda b: _rebuild(b, tensors=_set("extra", torch.zeros(2))),
        BundleTensorError,
        "unexpected tensor 'extra'",
    ),
    "wrong shape": (
        lambda b: _rebuild(b, tensors=_set("head.bias", torch.zeros(6))),
        BundleTensorError,
        "head bias has 6 rows",
    ),
    "wrong rank": (
        lambda b: _rebuild(b, tensors=_set("memory", torch.zeros(3, 64))),
        BundleTensorError,
        "memory must be 3-D",
    ),
    "wrong depth": (
        lambda b: _rebuild(b, tensors=_set("memory", torch.zeros(4, 3, 64))),
        BaseMismatchError,
        "memory for 4 layers, vit_tiny_patch16_224 has 3",
    ),
    "wrong width": (
        lambda b: _rebuild(
            b,
            tensors=lambda t: t.update(
                memory=torch.zeros(3, 1, 32), cls_token=torch.zeros(32), **{"head.weight": torch.zeros(5, 32)}
            ),
        ),
        BaseMismatchError,
        "width 32, vit_tiny_patch16_224 has width 64",
    ),
    "integer dtype": (
        lambda b: _rebuild(b, tensors=_set("head.weight", torch.zeros(5, 64, dtype=torch.int64))),
        BundleTensorError,
        "'head.weight' has dtype I64; expected a floating-point dtype",
    ),
    "NaN": (
        lambda b: _rebuild(b, tensors=lambda t: t["memory"].__setitem__((0, 0, 0), float("nan"))),
        BundleTensorError,
        "'memory' contains NaN or inf",
    ),
    "inf": (
        lambda b: _rebuild(b, tensors=lambda t: t["head.bias"].__setitem__(0, float("inf"))),
        BundleTensorError,
        "'head.bias' contains NaN or inf",
    ),
    "extreme but finite head": (
        lambda b: _rebuild(b, tensors=lambda t: t["head.weight"].__setitem__((0, 0), 3e38)),
        BundleTensorError,
        "'head.weight' has values up to 3e+38",
    ),
    "no classes": (
        lambda b: _rebuild(
            b,
            tensors=lambda t: t.update({"head.weight": torch.zeros(0, 64), "head.bias": torch.zeros(0)}),
            meta=_set("labels", "[]"),
        ),
        BundleTensorError,
        "the head has 0 classes",
    ),
    "labels count": (
        lambda b: _rebuild(b, meta=_set("labels", json.dumps(["a", "b", "c"]))),
        BundleMetadataError,
        "3 labels for a head of 5 classes",
    ),
    "labels not json": (
        lambda b: _rebuild(b, meta=_set("labels", "[a, b")),
        BundleMetadataError,
        "'labels' is not valid JSON",
    ),
    "bad name": (
        lambda b: _rebuild(b, meta=_set("name", "../etc/passwd")),
        BundleMetadataError,
        "invalid name '../etc/passwd'",
    ),
    "reserved name": (
        lambda b: _rebuild(b, meta=_set("name", "base")),
        BundleMetadataError,
        "invalid name 'base'",
    ),
    "bad memory_norm": (
        lambda b: _rebuild(b, meta=_set("memory_norm", "post")),
        BundleMetadataError,
        "memory_norm must be one of",
    ),
    "unknown format": (
        lambda b: _rebuild(b, meta=_set("format", "memvit.adapter/2")),
        BundleFormatError,
        "unknown format 'memvit.adapter/2'",
    ),
    "no metadata": (lambda b: save(b.tensors()), BundleFormatError, "no metadata"),
    "missing metadata": (
        lambda b: _rebuild(b, meta=_drop("base_model")),
        BundleMetadataError,
        "'base_model' is missing",
    ),
    "unknown metadata": (
        lambda b: _rebuild(b, meta=_set("colour", "red")),
        BundleMetadataError,
        "unknown metadata keys",
    ),
    "other architecture": (
        lambda b: _rebuild(b, meta=_set("base_model", "vit_base_patch32_224")),
        BaseMismatchError,
        "trained on vit_base_patch32_224",
    ),
    "fingerprint mismatch": (
        lambda b: _rebuild(b, meta=_set("base_fingerprint", "0" * 64)),
        BaseMismatchError,
        "trained on other vit_tiny_patch16_224 weights",
    ),
    "malformed fingerprint": (
        lambda b: _rebuild(b, meta=_set("base_fingerprint", "abc")),
        BundleMetadataError,
        "not a sha256",
    ),
    "missing parent": (
        lambda b: _rebuild(b, meta=_set("parent", "ghost")),
        MissingParentError,
        "extends 'ghost', which is not loaded",
    ),
    "duplicate name": (
        lambda b: _rebuild(b, meta=_set("name", "first")),
        DuplicateAdapterError,
        "'first' is already loaded",
    ),
    "truncated": (lambda b: b.to_bytes()[:-100], BundleFormatError, "truncated: tensors need"),
    "truncated header": (lambda b: b.to_bytes()[:40], BundleFormatError, "truncated: the header needs"),
    "empty": (lambda b: b"", BundleFormatError, "0 bytes is too short"),
    "json not safetensors": (lambda b: b'{"name": "new"}', BundleFormatError, "not a safetensors file"),
    "pickle": (lambda b: pickle.dumps(b.tensors()), BundleFormatError, "not a safetensors file"),
    "torch.save": (lambda b: _torch_save(b.tensors()), BundleFormatError, "not a safetensors file"),
}


def _torch_save(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_bundle_is_refused_and_nothing_changes(case: str, loaded, tmp_path) -> None:
    live, good = loaded
    engine = live.engine
    make, error, message = BAD[case]
    data = make(good)
    before = live.current
    x = images(engine)
    logits_before = engine(x, before)
    for source in (data, _write(tmp_path / "bad.safetensors", data)):
        with pytest.raises(error, match=re.escape(message)) as info:
            attach_bundle(live, source)
        assert isinstance(info.value, AdapterError)
        assert live.current is before
    after = engine(x, live.current)
    assert after.adapter_set is before
    for name in before.names:
        assert max_diff(after.adapters[name], logits_before.adapters[name]) == 0.0


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


def test_real_jpeg_is_not_a_bundle(loaded) -> None:
    photo = SHARED_DATA / "photos" / "formats" / "hopper.jpg"
    if not photo.is_file():
        pytest.skip(f"{photo} not found (../shared/data is absent)")
    live, _ = loaded
    with pytest.raises(BundleFormatError, match="not a safetensors file"):
        attach_bundle(live, photo)


def test_size_cap(loaded) -> None:
    _, good = loaded
    with pytest.raises(BundleFormatError, match="over the 100-byte limit"):
        read_bundle(good.to_bytes(), max_bytes=100)


def test_extension_bundle_attaches_after_parent(loaded) -> None:
    live, _ = loaded
    child = bundle_for(random_adapter("child", live.engine, m=1, parent="first"), live.engine)
    data = child.to_bytes()
    assert read_bundle(data).weights.parent == "first"
    attach_bundle(live, data)
    assert live.current.lineage("child") == ["child", "first"]


def test_format_constant() -> None:
    assert FORMAT == "memvit.adapter/1"
