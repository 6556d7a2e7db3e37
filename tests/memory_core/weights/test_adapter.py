"""AdapterWeights: the one place an adapter is validated (the reader, trainer and engine rely on it)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from memvit.memory_core import (
    AdapterShapeError,
    AdapterWeights,
    InvalidAdapterError,
    check_memory_norm,
    check_name,
)
from tests.conftest import tiny_engine

GOOD = dict(
    name="a",
    memory=torch.zeros(3, 1, 64),
    cls_token=torch.zeros(64),
    head_weight=torch.zeros(2, 64),
    head_bias=torch.zeros(2),
)


def _nan(shape):
    t = torch.zeros(shape)
    t.view(-1)[0] = float("nan")
    return t


@pytest.mark.parametrize(
    "kwargs,error,field,match",
    [
        (dict(name="Bad Name"), InvalidAdapterError, "name", "invalid name 'Bad Name'"),
        (dict(name="../etc"), InvalidAdapterError, "name", "invalid name"),
        (dict(name="x" * 65), InvalidAdapterError, "name", "1-64 characters"),
        (dict(name=3), InvalidAdapterError, "name", "invalid name 3"),
        (dict(name="base"), InvalidAdapterError, "name", "reserved"),
        (dict(parent="Bad/"), InvalidAdapterError, "parent", "invalid parent"),
        (dict(parent="a"), InvalidAdapterError, "parent", "itself"),
        (dict(memory_norm="post"), InvalidAdapterError, "memory_norm", "memory_norm must be one of"),
        (dict(head_bias=torch.zeros(3)), AdapterShapeError, "head_bias", "head bias has 3 rows"),
        (dict(head_weight=torch.zeros(2, 8)), AdapterShapeError, "head_weight", "reads width 8"),
        (dict(memory=torch.zeros(3, 1, 5)), AdapterShapeError, "memory", "memory has width 5"),
        (dict(memory=torch.zeros(3, 5)), AdapterShapeError, "memory", "memory must be 3-D"),
        (dict(memory=[[0.0]]), AdapterShapeError, "memory", "must be a tensor"),
        (
            dict(cls_token=torch.zeros(64, dtype=torch.int64)),
            AdapterShapeError,
            "cls_token",
            "floating-point",
        ),
        (dict(labels=("x",)), InvalidAdapterError, "labels", "1 labels for a head of 2"),
        (dict(labels=("x", 2)), InvalidAdapterError, "labels", "tuple of strings"),
        (dict(labels=["x", "y"]), InvalidAdapterError, "labels", "tuple of strings"),
        (dict(memory=_nan((3, 1, 64))), InvalidAdapterError, "memory", "'memory' contains NaN or inf"),
        (dict(head_bias=torch.tensor([0.0, float("inf")])), InvalidAdapterError, "head_bias", "NaN or inf"),
        (dict(head_weight=torch.full((2, 64), 3e38)), InvalidAdapterError, "head_weight", "within \\+-10000"),
        (dict(memory=torch.full((3, 1, 64), -2e4)), InvalidAdapterError, "memory", "values up to 2e\\+04"),
        (
            dict(head_weight=torch.zeros(0, 64), head_bias=torch.zeros(0)),
            AdapterShapeError,
            "head_weight",
            "0 classes",
        ),
    ],
)
def test_every_rule_is_checked_on_construction(kwargs, error, field, match) -> None:
    with pytest.raises(error, match=match) as info:
        AdapterWeights(**{**GOOD, **kwargs})
    assert info.value.field == field


def test_a_trainers_live_parameters_skip_only_the_value_checks() -> None:
    # check_values=False (a trainer's own parameters, rebuilt every step) skips NaN and range checks,
    # never the shape checks; dataclasses.replace checks values again unless told otherwise.
    w = AdapterWeights(**{**GOOD, "memory": _nan((3, 1, 64))}, check_values=False)
    assert w.memory.isnan().any()
    with pytest.raises(AdapterShapeError, match="memory has width 5"):
        AdapterWeights(**{**GOOD, "memory": torch.zeros(3, 1, 5)}, check_values=False)
    with pytest.raises(InvalidAdapterError, match="NaN or inf"):
        dataclasses.replace(w, name="b")


def test_a_valid_adapter_and_its_shape() -> None:
    w = AdapterWeights(**GOOD, labels=("x", "y"), parent="p", memory_norm="none")
    assert (w.depth, w.num_memory, w.width, w.num_classes) == (3, 1, 64, 2)
    assert not w.requires_grad
    assert AdapterWeights(**{**GOOD, "memory": torch.zeros(3, 0, 64)}).num_memory == 0  # class token + head


def test_check_fits_needs_the_base_depth_and_width() -> None:
    spec = tiny_engine().spec  # depth 3, width 64
    AdapterWeights(**GOOD).check_fits(spec)
    with pytest.raises(AdapterShapeError, match="memory for 4 layers, vit_tiny_patch16_224 has 3"):
        AdapterWeights(**{**GOOD, "memory": torch.zeros(4, 1, 64)}).check_fits(spec)
    narrow = dict(memory=torch.zeros(3, 1, 8), cls_token=torch.zeros(8), head_weight=torch.zeros(2, 8))
    with pytest.raises(AdapterShapeError, match="width 8, vit_tiny_patch16_224 has width 64"):
        AdapterWeights(**{**GOOD, **narrow}).check_fits(spec)


def test_rule_helpers_are_the_same_rules() -> None:
    check_name("ok-name_1.2")
    check_memory_norm("none")
    with pytest.raises(InvalidAdapterError, match="invalid name"):
        check_name("Nope")
    with pytest.raises(InvalidAdapterError, match="memory_norm"):
        check_memory_norm("post")


def test_initialise_is_the_papers_start() -> None:
    engine = tiny_engine()
    base_cls = engine.base.cls_token.detach().reshape(-1)
    w = AdapterWeights.initialise(
        "fresh", engine.spec, num_memory=4, num_classes=3, cls_token=engine.base.cls_token,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    assert w.memory.shape == (3, 4, 64) and 0.01 < w.memory.std().item() < 0.03  # N(0, 0.02)
    assert torch.equal(w.cls_token, base_cls)
    assert not w.head_weight.any() and not w.head_bias.any()
    with pytest.raises(AdapterShapeError, match="num_classes >= 1"):
        AdapterWeights.initialise("x", engine.spec, num_memory=0, num_classes=0)
