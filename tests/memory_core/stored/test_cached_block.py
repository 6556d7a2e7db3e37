"""The written-out class-token block of training from a cache (memory_core/stored/cached_block.py): the same
logits and gradients as the generic, recorded path, and taken exactly where it applies."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import memvit.memory_core.stored.cached_block as cached_block
from memvit.memory_core import AdapterSet, AdapterWeights, MemoryViT
from memvit.memory_core.block.attention import LayerMemory
from memvit.memory_core.stored.cached import CachedBatch, capture
from memvit.memory_core.stored.folded_attention import folded
from memvit.memory_core.stored.stored_attention import NormedInputs, StoredKeysValues
from tests.conftest import images
from tests.factories import VARIANTS, random_adapter, tiny_engine

original = cached_block.written_out  # the real rule, before any test patches it


def _trainable(engine: MemoryViT, name: str, m: int, *, head_only: bool = False) -> AdapterWeights:
    w = random_adapter(name, engine, m=m, seed=len(name))
    w = dataclasses.replace(w, **{k: getattr(w, k).to(engine.dtype) for k in ("memory", "cls_token")})
    w = dataclasses.replace(
        w, head_weight=w.head_weight.to(engine.dtype), head_bias=w.head_bias.to(engine.dtype)
    )
    grads = {"head_weight", "head_bias"} | ({"memory", "cls_token"} if not head_only else set())
    return dataclasses.replace(
        w, **{k: getattr(w, k).clone().requires_grad_(k in grads) for k in grads | {"memory", "cls_token"}}
    )


def _served(engine: MemoryViT, name: str, m: int, memory_norm: str) -> AdapterWeights:
    w = random_adapter(name, engine, m=m, memory_norm=memory_norm, seed=len(name))
    tensors = ("memory", "cls_token", "head_weight", "head_bias")
    return dataclasses.replace(w, **{k: getattr(w, k).to(engine.dtype) for k in tensors})


def _logits_and_grads(
    engine: MemoryViT, batch: CachedBatch, write_out: bool, monkeypatch
) -> tuple[dict, dict]:
    monkeypatch.setattr(cached_block, "written_out", lambda *a: write_out and original(*a))
    adapters = [
        _trainable(engine, "memory3", 3),
        _trainable(engine, "none", 0),
        _trainable(engine, "head", 0, head_only=True),
    ]
    out = engine(batch, AdapterSet(tuple(engine.prepare(w) for w in adapters)))
    weights = torch.linspace(-1, 1, 5, dtype=engine.dtype)
    sum((out.adapters[w.name] * weights).sum() for w in adapters).backward()
    grads = {
        (w.name, k): getattr(w, k).grad for w in adapters for k in ("memory", "cls_token", "head_weight")
    }
    return out.adapters, grads


def test_the_written_out_block_equals_the_recorded_path_in_float64(monkeypatch) -> None:
    engine = tiny_engine().double()
    engine.train()  # as training runs it (the base stays in eval mode)
    base_logits, layers = capture(engine, images(engine, batch=4).double(), "inputs")
    batch = CachedBatch("inputs", layers, base_logits)
    taken = []
    monkeypatch.setattr(
        cached_block._ClassTokenBlock, "apply", _counting(cached_block._ClassTokenBlock.apply, taken)
    )
    fused, fused_grads = _logits_and_grads(engine, batch, True, monkeypatch)
    assert len(taken) == engine.spec.depth  # every block written out
    recorded, recorded_grads = _logits_and_grads(engine, batch, False, monkeypatch)
    assert len(taken) == engine.spec.depth  # and none when it is off
    for name, logits in recorded.items():
        assert (fused[name] - logits).abs().max() <= 1e-12, name
    for key, grad in recorded_grads.items():
        if grad is None:
            assert fused_grads[key] is None, key
        else:
            assert (fused_grads[key] - grad).abs().max() <= 1e-12, key
    assert fused_grads[("memory3", "memory")].abs().sum() > 0 and fused_grads[("head", "cls_token")] is None


def _counting(apply, taken: list):
    def counted(*args):
        taken.append(1)
        return apply(*args)

    return staticmethod(counted)


def test_the_written_out_block_passes_gradcheck() -> None:
    # Narrow (width 16, two heads): gradcheck perturbs every input element, two passes each, so the
    # Jacobian it checks whole is a quarter of the width-64 one's, every path of the block kept.
    engine = tiny_engine(embed_dim=16, num_heads=2).double()
    block = engine.base.blocks[1]
    g = torch.Generator().manual_seed(0)
    B, K, P, T, D = 2, 3, 2, 5, engine.spec.width
    c = torch.randn(B, K, D, generator=g, dtype=torch.float64, requires_grad=True)
    memory = torch.randn(K, P, D, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.tensor(  # the token itself first, then its memory: full, half padding, all padding
        [[0.0, 0.0, 0.0], [0.0, 0.0, float("-inf")], [0.0, float("-inf"), float("-inf")]], dtype=torch.float64
    )
    h = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    fn, f = cached_block._ClassTokenBlock.apply, folded(block.attn)
    assert torch.autograd.gradcheck(lambda c, m: fn(c, m, h, block, bias, f), (c, memory))


def test_evaluation_reads_the_memory_rows_it_was_not_given(monkeypatch) -> None:
    """A set prepared for serving holds keys and values only; from a cache it still takes the
    written-out block (its memory's rows made from the adapters' weights) and gives the same logits."""
    engine = tiny_engine().double()
    base_logits, layers = capture(engine, images(engine, batch=3).double(), "inputs")
    batch = CachedBatch("inputs", layers, base_logits)
    adapters = [_served(engine, n, m, norm) for n, m, norm in (("three", 3, "norm1"), ("none", 0, "norm1"))]
    adapters += [_served(engine, "one", 1, "norm1"), _served(engine, "raw", 2, "none")]
    with torch.no_grad():
        adapter_set = engine.prepare_set(adapters)
        assert all(layer.inputs is None for layer in adapter_set.stack.layers)  # serving's set
        taken = []
        monkeypatch.setattr(
            cached_block._ClassTokenBlock, "apply", _counting(cached_block._ClassTokenBlock.apply, taken)
        )
        written = engine(batch, adapter_set).adapters
        assert len(taken) == engine.spec.depth
        monkeypatch.setattr(cached_block, "written_out", lambda *a: False)
        recorded = engine(batch, adapter_set).adapters
    for name, logits in recorded.items():
        torch.testing.assert_close(written[name], logits, rtol=0, atol=1e-12)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_block_is_written_out_only_where_it_computes_the_same(variant: str) -> None:
    engine = tiny_engine(variant)
    block = engine.base.blocks[0]
    K, H, d = 2, engine.spec.num_heads, engine.spec.head_dim
    memory = LayerMemory(
        torch.zeros(K, H, 1, d),
        torch.zeros(K, H, 1, d),
        torch.zeros(K, 1),
        torch.arange(K)[:, None],
        torch.zeros(K, 1),
        inputs=torch.zeros(K, 1, engine.spec.width),
    )
    h = NormedInputs(torch.zeros(1, engine.spec.num_tokens, engine.spec.width))
    plain = variant in ("plain", "registers", "registers_embedded")  # qk norm and layer scale are not
    assert cached_block.written_out(block, h, memory) is plain
    lineage = dataclasses.replace(
        memory, lineage=torch.tensor([[0, 1], [1, 0]]), lineage_bias=torch.zeros(K, 2)
    )
    routed = dataclasses.replace(memory, lineage=memory.lineage.expand(3, K, 1))
    stored = StoredKeysValues(torch.zeros(1, H, 4, d), torch.zeros(1, H, 4, d))
    no_rows = dataclasses.replace(memory, inputs=None)
    assert not any(
        cached_block.written_out(block, base, mem)
        for base, mem in [(h, lineage), (h, routed), (stored, memory), (h, no_rows)]
    )
