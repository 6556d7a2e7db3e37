"""Training's memory projection, every layer in one product (memory_core/stored/memory_projection.py): the
keys, values and gradients of the layer-by-layer projection, and taken exactly where it applies."""

from __future__ import annotations

import pytest
import torch

from memvit.memory_core import MemoryViT
from memvit.memory_core.block import attention
from memvit.memory_core.stored.memory_projection import StackedProjection
from tests.factories import tiny_base, tiny_engine


def _layer_by_layer(engine: MemoryViT, memory: torch.Tensor, norm: str) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = [
        attention.project_memory(b, rows, norm) for b, rows in zip(engine.base.blocks, memory, strict=True)
    ]
    return torch.stack([k for k, _ in pairs]), torch.stack([v for _, v in pairs])


def _memory(engine: MemoryViT, m: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(m)
    return torch.randn(engine.spec.depth, m, engine.spec.width, generator=g, dtype=engine.dtype)


def _keys_values_and_grad(project, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    memory = memory.clone().requires_grad_(True)
    k, v = project(memory)
    g = torch.Generator().manual_seed(1)
    (
        k * torch.randn(k.shape, generator=g, dtype=k.dtype)
        + v * torch.randn(v.shape, generator=g, dtype=v.dtype)
    ).sum().backward()
    return k.detach(), v.detach(), memory.grad


@pytest.mark.parametrize("variant", ["plain", "registers", "registers_embedded"])
@pytest.mark.parametrize("norm", ["norm1", "none"])
def test_every_layer_at_once_equals_layer_by_layer_in_float64(variant: str, norm: str) -> None:
    engine = tiny_engine(variant).double()
    stacked = StackedProjection()
    memory = _memory(engine)
    got = _keys_values_and_grad(lambda x: stacked.project(engine.base.blocks, x, norm)[:2], memory)
    want = _keys_values_and_grad(lambda x: _layer_by_layer(engine, x, norm), memory)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    # and the rows they are projected from: what the cached block reads (memory_core/stored/cached_block.py)
    rows = stacked.project(engine.base.blocks, memory, norm)[2]
    blocks = engine.base.blocks
    want_rows = (
        memory if norm != "norm1" else torch.stack([b.norm1(m) for b, m in zip(blocks, memory, strict=True)])
    )
    torch.testing.assert_close(rows, want_rows, rtol=0, atol=1e-12)


def test_the_engine_takes_it_for_trainable_memory_only() -> None:
    engine = tiny_engine()
    memory = _memory(engine)
    taken = []
    original = engine._stacked_projection.project
    engine._stacked_projection.project = lambda *a: taken.append(1) or original(*a)
    k, _ = engine.project_memory(memory, "norm1")  # serving: layer by layer, nothing recorded
    assert not taken and k.grad_fn is None
    k, _ = engine.project_memory(memory.requires_grad_(True), "norm1")
    assert taken and k.grad_fn is not None
    torch.testing.assert_close(k, _layer_by_layer(engine, memory, "norm1")[0])


def test_a_batch_invariant_engine_keeps_its_fixed_blocks() -> None:
    engine = MemoryViT(tiny_base(), batch_invariant=True)
    engine._stacked_projection.project = lambda *a: pytest.fail(
        "the batch-invariant mode projects in fixed blocks"
    )
    k, _ = engine.project_memory(_memory(engine).requires_grad_(True), "norm1")
    assert k.grad_fn is not None


def test_a_base_it_does_not_cover_projects_layer_by_layer() -> None:
    engine = tiny_engine("qknorm_layerscale_prenorm")  # its keys pass through k_norm
    assert StackedProjection().project(engine.base.blocks, _memory(engine), "norm1") is None
    memory = _memory(engine).requires_grad_(True)
    torch.testing.assert_close(
        engine.project_memory(memory, "norm1")[0], _layer_by_layer(engine, memory, "norm1")[0]
    )


def test_the_stack_follows_the_base_weights() -> None:
    engine = tiny_engine()
    stacked, memory = StackedProjection(), _memory(engine)
    before = stacked.project(engine.base.blocks, memory, "norm1")[1]
    with torch.no_grad():
        engine.base.blocks[1].attn.qkv.weight.mul_(2)  # in place: same storage, a new version
    after = stacked.project(engine.base.blocks, memory, "norm1")[1]
    assert not torch.equal(before[1], after[1]) and torch.equal(before[0], after[0])
    torch.testing.assert_close(after, _layer_by_layer(engine, memory, "norm1")[1])
    engine = engine.double()  # a new storage and dtype
    torch.testing.assert_close(
        stacked.project(engine.base.blocks, memory.double(), "norm1")[0],
        _layer_by_layer(engine, memory.double(), "norm1")[0],
    )
