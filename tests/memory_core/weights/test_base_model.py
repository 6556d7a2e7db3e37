"""Building the base: local weights files, self-describing metadata, and clear refusals."""

from __future__ import annotations

import json

import pytest
import timm
import torch
from safetensors.torch import save_file
from timm.models.vision_transformer import ResPostBlock, VisionTransformer

from memvit.memory_core import (
    BaseModel,
    MemoryViT,
    UnsupportedModelError,
    WeightsError,
    create_base,
    save_base,
    state_fingerprint,
)
from tests.conftest import TINY, images, max_diff, tiny_base


@pytest.fixture
def tiny_weights(tmp_path):
    base = tiny_base()
    path = tmp_path / "tiny.safetensors"
    meta = {
        "arch": "vit_tiny_patch16_224",
        "model_kwargs": json.dumps(TINY),
        "labels": json.dumps(list("abcdefg")),
    }
    save_file(base.model.state_dict(), str(path), metadata=meta)
    return base, path


def test_self_describing_safetensors_file(tiny_weights) -> None:
    base, path = tiny_weights
    engine = MemoryViT.from_timm(weights=str(path))
    assert engine.spec.arch == "vit_tiny_patch16_224"
    assert engine.labels == tuple("abcdefg")
    assert engine.fingerprint == state_fingerprint(base.model.state_dict())
    x = images(engine)
    assert max_diff(engine(x).base, base.model(x)) == 0.0


def test_pth_file_and_head_size_from_checkpoint(tmp_path) -> None:
    base = tiny_base(num_classes=3)
    path = tmp_path / "tiny.pth"
    torch.save({"state_dict": base.model.state_dict()}, path)
    kwargs = {k: v for k, v in TINY.items() if k != "num_classes"}
    engine = MemoryViT.from_timm("vit_tiny_patch16_224", weights=str(path), **kwargs)
    assert engine.spec.num_classes == 3
    x = images(engine)
    assert max_diff(engine(x).base, base.model(x)) == 0.0


def test_missing_file(tmp_path) -> None:
    with pytest.raises(WeightsError, match="weights file not found"):
        create_base("vit_tiny_patch16_224", weights=tmp_path / "nope.safetensors")


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_garbage_file(tmp_path) -> None:
    path = tmp_path / "junk.safetensors"
    path.write_bytes(b"this is not a tensor file at all")
    with pytest.raises(WeightsError, match="not a readable safetensors file"):
        create_base("vit_tiny_patch16_224", weights=path)
    pth = tmp_path / "junk.pth"
    pth.write_bytes(b"\x80\x04garbage")
    with pytest.raises(WeightsError, match="cannot read weights"):
        create_base("vit_tiny_patch16_224", weights=pth)


def test_weights_for_another_architecture(tmp_path) -> None:
    path = tmp_path / "tiny.safetensors"
    save_file(tiny_base().model.state_dict(), str(path))
    with pytest.raises(WeightsError, match=r"does not fit vit_small_patch16_224: .*size mismatch"):
        create_base("vit_small_patch16_224", weights=path, img_size=32, patch_size=8)


def test_no_architecture(tmp_path) -> None:
    path = tmp_path / "anon.safetensors"
    save_file(tiny_base().model.state_dict(), str(path))
    with pytest.raises(WeightsError, match="no architecture given"):
        create_base(weights=path)


def test_unknown_architecture() -> None:
    with pytest.raises(UnsupportedModelError, match="unknown timm architecture 'vit_nonsense'"):
        create_base("vit_nonsense")


@pytest.mark.parametrize(
    "build,reason",
    [
        (lambda: timm.create_model("resnet18"), "not a timm VisionTransformer"),
        (lambda: VisionTransformer(**TINY, class_token=False, global_pool="avg"), "has no class token"),
        (lambda: VisionTransformer(**TINY, global_pool="avg"), "global_pool='avg'"),
        (lambda: VisionTransformer(**TINY, global_pool="map"), "global_pool='map'"),
        (lambda: VisionTransformer(**TINY, block_fn=ResPostBlock), "ResPostBlock"),
    ],
)
def test_models_that_cannot_host_adapters_are_refused(build, reason) -> None:
    with pytest.raises(UnsupportedModelError, match=reason):
        MemoryViT(BaseModel(model=build(), arch="test"))


def test_fingerprint_names_the_weights_not_the_dtype() -> None:
    base = tiny_base()
    fp = state_fingerprint(base.model.state_dict())
    assert fp == state_fingerprint({k: v.clone() for k, v in base.model.state_dict().items()})
    engine = MemoryViT(base, dtype=torch.float64)
    assert engine.fingerprint == fp
    other = tiny_base(seed=1)
    assert state_fingerprint(other.model.state_dict()) != fp
    tweaked = dict(base.model.state_dict())
    tweaked["head.bias"] = tweaked["head.bias"].clone()
    tweaked["head.bias"][0] += 1e-6
    assert state_fingerprint(tweaked) != fp


def test_real_deit_tiny_loads_from_its_file(deit_tiny_path) -> None:
    base = create_base(weights=deit_tiny_path)
    assert base.arch == "deit_tiny_patch16_224"
    assert base.model.num_classes == 1000


def test_save_base_round_trips_weights_labels_and_preprocessing(tmp_path) -> None:
    base = tiny_base()
    data_config = {"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "crop_pct": 1.0}
    path = save_base(
        base.model,
        tmp_path / "base.safetensors",
        arch="vit_tiny_patch16_224",
        model_kwargs=TINY,
        labels=tuple("abcdefg"),
        data_config=data_config,
        extra={"trained_on": "nothing", "arch": "ignored: reserved keys win"},
    )
    engine = MemoryViT.from_timm(weights=str(path))
    assert engine.spec.arch == "vit_tiny_patch16_224" and engine.labels == tuple("abcdefg")
    assert engine.fingerprint == state_fingerprint(base.model.state_dict())
    assert tuple(engine.data_config()["mean"]) == (0.5, 0.5, 0.5) and engine.data_config()["crop_pct"] == 1.0
    x = images(engine)
    assert max_diff(engine(x).base, base.model(x)) == 0.0


def test_save_base_refuses_a_model_that_cannot_host_adapters(tmp_path) -> None:
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, class_token=False,
                              global_pool="avg", embed_dim=32, depth=1, num_heads=2)  # fmt: skip
    with pytest.raises(UnsupportedModelError):
        save_base(model, tmp_path / "x.safetensors", arch="vit_tiny_patch16_224")
    assert not (tmp_path / "x.safetensors").exists()
