"""The products apart (block/apart.py): the base rows' every product on the base pass's own shape,
so the base logits are timm's bit for bit; the adapters' logits the dense oracle's, on both kernels."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from memvit.memory_core import LiveAdapters
from memvit.memory_core.block.apart import apart_supported, products_apart
from memvit.memory_core.oracle.reference import DenseMemoryViT
from tests.conftest import TOL, assert_tasks_match, images, max_diff, random_adapter, tiny_engine


def _adapters(engine):
    return [
        random_adapter("m0", engine, m=0),
        random_adapter("m1", engine, m=1, memory_norm="none"),
        random_adapter("m5", engine, m=5, classes=11),
        random_adapter("child", engine, m=2, parent="m1"),  # extension mode: lineage of 2
    ]


@pytest.mark.parametrize(
    ("variant", "kernels"),
    [
        ("plain", "torch"),
        ("registers", "torch"),
        ("qknorm_layerscale_prenorm", "torch"),
        ("plain", "triton"),  # Triton's interpreter on the CPU: slow, one variant
    ],
)
def test_base_is_timm_bit_for_bit_and_adapters_the_oracle(variant: str, kernels: str) -> None:
    engine = tiny_engine(variant)
    engine.kernels, engine.row_gemms = kernels, "apart"
    adapters = _adapters(engine)
    x = images(engine, batch=3)
    loaded = engine.prepare_set(adapters)
    tasks = [["m0", "child"], ["m5"], ["m1", "m0", "m5"]]
    with torch.no_grad():
        timm_logits = engine.base(x)
        every = engine(x, loaded)
        routed = engine(x, loaded, tasks=tasks)
    assert torch.equal(every.base, timm_logits) and torch.equal(routed.base, timm_logits)
    _, ref = DenseMemoryViT(engine.base, adapters)(x)
    assert_tasks_match(every, routed, tasks, ref)


def test_joined_products_round_the_base_otherwise_but_within_tolerance() -> None:
    engine = tiny_engine()
    adapters = _adapters(engine)
    x = images(engine, batch=3)
    loaded = engine.prepare_set(adapters)
    with torch.no_grad():
        apart = (setattr(engine, "row_gemms", "apart"), engine(x, loaded))[1]
        joined = (setattr(engine, "row_gemms", "joined"), engine(x, loaded))[1]
    assert max_diff(apart.base, joined.base) <= TOL
    for a in adapters:
        assert max_diff(apart.adapters[a.name], joined.adapters[a.name]) <= TOL


@torch.no_grad()
def test_products_apart_are_each_half_alone() -> None:
    g = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(24, 40)
    base, rows = torch.randn(37, 24, generator=g), torch.randn(5, 24, generator=g)
    out = products_apart(linear, base, rows)
    assert out.shape == (42, 40)
    assert torch.equal(out[:37], F.linear(base, linear.weight, linear.bias))
    assert torch.equal(out[37:], F.linear(rows, linear.weight, linear.bias))
    linear.bias = None
    assert torch.equal(products_apart(linear, base, rows)[:37], F.linear(base, linear.weight))


def test_other_blocks_keep_the_joined_products() -> None:
    engine = tiny_engine()
    block = engine.base.blocks[0]
    assert apart_supported(block)
    block.mlp.fc2 = torch.nn.Sequential(block.mlp.fc2)  # not a plain Linear: the pass stays joined
    assert not apart_supported(block)
    engine.row_gemms = "apart"
    adapters = _adapters(engine)
    x = images(engine, batch=2)
    with torch.no_grad():
        out = engine(x, engine.prepare_set(adapters))
    _, ref = DenseMemoryViT(engine.base, adapters)(x)
    assert max_diff(out.base, engine.base(x)) <= TOL
    for a in adapters:
        assert max_diff(out.adapters[a.name], ref[a.name]) <= TOL


def test_an_unknown_setting_is_refused() -> None:
    engine = tiny_engine()
    engine.row_gemms = "sideways"
    loaded = engine.prepare_set([random_adapter("a", engine)])
    with pytest.raises(ValueError, match="gemms"):
        engine(images(engine), loaded)


class _Products(TorchDispatchMode):
    """The (rows, in, out) of every matrix product dispatched."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: Counter[tuple[int, int, int]] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.addmm, torch.ops.aten.mm):
            a, b = (args[1], args[2]) if func.overloadpacket is torch.ops.aten.addmm else args[:2]
            self.shapes[(a.shape[0], a.shape[1], b.shape[1])] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("gemms", ["joined", "apart"])
def test_apart_runs_every_product_of_the_base_pass_on_its_shape(gemms: str) -> None:
    engine = tiny_engine()
    engine.row_gemms = gemms
    x = images(engine, batch=3)
    loaded = engine.prepare_set(_adapters(engine))
    with torch.no_grad():
        with _Products() as timm_products:
            engine.base.forward_features(x)
        with _Products() as pass_products:
            engine(x, loaded, tasks=[["m0"], ["m5", "child"], []])
    base_shapes = set(timm_products.shapes)
    assert len(base_shapes) == 4  # qkv, proj, fc1, fc2 on B*T rows
    found = {s: pass_products.shapes[s] for s in base_shapes}
    if gemms == "apart":
        assert found == dict(timm_products.shapes)  # each as many times as in timm's own pass
    else:
        assert set(found.values()) == {0}  # joined: every product over B*(T+R) rows instead


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apart_on_cuda_is_timm_bit_for_bit(dtype: torch.dtype) -> None:
    """On a GPU the products' kernels depend on their row count: apart, the base rows' are timm's."""
    engine = tiny_engine().to("cuda", dtype)
    engine.row_gemms = "apart"
    adapters = _adapters(engine)
    live = LiveAdapters(engine)
    live.replace_all(adapters)
    x = images(engine, batch=8).to("cuda", dtype)
    with torch.inference_mode():
        expected = engine.base(x)
        for tasks in (None, [["m0"], ["m5", "child"]] * 4):
            assert torch.equal(engine(x, live.current, tasks=tasks).base, expected)
