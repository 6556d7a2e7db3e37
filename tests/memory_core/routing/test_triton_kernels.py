"""The Triton kernels (memory_core/routing/triton_kernels.py) against the dense reference and the torch path.

Without a GPU they run under Triton's interpreter (tests/conftest.py sets ``TRITON_INTERPRET``), so
CI holds the very kernels a GPU runs to the same bounds as the torch path. The interpreter is slow:
shapes stay tiny, but cover several key tiles, row tiles, memory chunks and class tiles.
"""

from __future__ import annotations

import pytest
import torch

from memvit.memory_core.block.attention import KeysValues, LayerMemory, class_token_attention
from memvit.memory_core.oracle.reference import DenseMemoryViT
from memvit.memory_core.routing import kernel_tiles, triton_kernels
from memvit.memory_core.routing.planned import gathered_heads, shared_heads
from memvit.memory_core.routing.slots import SlotPools
from tests.conftest import TOL, images, max_diff, random_adapter, tiny_engine

pytestmark = pytest.mark.skipif(not triton_kernels.available(), reason="Triton is not installed")


def mixed(engine):
    return [
        random_adapter("m0", engine, m=0),
        random_adapter("m1", engine, m=1, memory_norm="none", classes=3),
        random_adapter("m12", engine, m=12, classes=11),  # two memory chunks
        random_adapter("child", engine, m=2, parent="m12", classes=2),  # lineage of two
        random_adapter("grandchild", engine, m=1, parent="child", memory_norm="none"),
    ]


@pytest.mark.parametrize("variant", ["plain", "qknorm_layerscale_prenorm"])
def test_engine_on_triton_kernels_equals_the_dense_reference(variant: str) -> None:
    engine = tiny_engine(variant)
    adapters = mixed(engine)
    loaded = engine.prepare_set(adapters)
    x = images(engine, batch=2)
    base_ref, ref = DenseMemoryViT(engine.base, adapters)(x)
    torch_out = engine(x, loaded)
    engine.kernels = "triton"
    out = engine(x, loaded)
    assert torch.equal(out.base, torch_out.base)  # the base rows take the same operations
    assert max_diff(out.base, base_ref) <= TOL
    for a in adapters:
        assert max_diff(out.adapters[a.name], ref[a.name]) <= TOL
    tasks = [["grandchild", "m1"], ["m0"]]  # routed: ancestors computed, not answered
    routed = engine(x, loaded, tasks=tasks)
    assert set(routed.adapters) == {"grandchild", "m1", "m0"}
    for name, logits in routed.adapters.items():
        assert max_diff(logits, ref[name][routed.images[name]]) <= TOL


def _attention_inputs(B: int, H: int, T: int, R: int, d: int, S: int, P: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, T + R, 3, H, d, generator=g).permute(2, 0, 3, 1, 4)  # views, as a block has them
    q, k, v = qkv.unbind(0)
    keys, values = torch.randn(2, S, H, P, d, generator=g).unbind(0)
    length = torch.randint(0, P + 1, (S,), generator=g, dtype=torch.int32)
    length[0] = 0  # the null slot
    slots = torch.randint(0, S, (B, R), generator=g)
    return q, k, v, keys, values, length, slots


def _torch_attention(q, k, v, keys, values, length, slots, scale: float, T: int) -> torch.Tensor:
    """The class-token rows' attention by the torch path: (B, R, H, d)."""
    B, R, P = q.shape[0], q.shape[2] - T, keys.shape[2]
    bias = torch.where(torch.arange(P)[None, :] < length[:, None].long(), 0.0, float("-inf"))

    class Attn:  # what class_token_attention reads of timm's Attention
        attn_drop = torch.nn.Identity()

    Attn.scale = scale
    own = torch.arange(R).view(1, R, 1).expand(B, R, 1)
    memory = LayerMemory(keys[slots], values[slots], bias[slots], own, torch.zeros(B, R, 1))
    kv = KeysValues(k[:, :, :T], v[:, :, :T])
    return class_token_attention(Attn, q[:, :, T:], k[:, :, T:], v[:, :, T:], kv, memory).transpose(1, 2)


@pytest.mark.parametrize("R", [1, 5, 70])  # one row tile (mostly padding) to two
def test_adapter_attention_kernel_equals_the_torch_attention(R: int) -> None:
    B, H, T, d, S, P = 2, 2, 70, 16, 6, 11  # two key tiles, two memory chunks
    q, k, v, keys, values, length, slots = _attention_inputs(B, H, T, R, d, S, P)
    scale = d**-0.5
    o = torch.zeros(B, T + R, H, d)
    rows = (q[:, :, T:], k[:, :, T:], v[:, :, T:], k[:, :, :T], v[:, :, :T])
    triton_kernels.class_token_attention_kernel(o[:, T:], *rows, keys, values, length, slots, None, scale)
    expected = _torch_attention(q, k, v, keys, values, length, slots, scale, T)
    assert max_diff(o[:, T:], expected) <= 1e-5
    assert torch.equal(o[:, :T], torch.zeros(B, T, H, d))  # the base rows are left alone


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.parametrize(
    ("tiles", "dtype", "bound"),
    [(t, torch.bfloat16, 0.05) for t in ("registers", "wide", "narrow", "deep")]
    + [("registers", torch.float32, 1e-4)],
)
def test_every_tile_set_compiled_for_the_gpu_equals_the_torch_attention(tiles, dtype, bound, monkeypatch):
    """kernel_tiles.py's tile sets (the GPU suite's tiles try) as compiled for the device: 16-row and
    64-row tiles (R = 5, 70), 4 warps to 16, memory one position per step or in chunks. (Under
    Triton's interpreter float32 and float16 pass it; bfloat16 does not: numpy has no bfloat16.)"""
    monkeypatch.setattr(kernel_tiles, "TILES", tiles)
    B, H, T, d, S, P = 2, 3, 197, 64, 6, 11  # ViT-B/16's keys and head width; memory up to 11
    for R in (5, 70):
        q, k, v, keys, values, length, slots = _attention_inputs(B, H, T, R, d, S, P)
        expected = _torch_attention(q, k, v, keys, values, length, slots, d**-0.5, T)
        on = [t.to("cuda", dtype) for t in (q, k, v, keys, values)]
        q_, k_, v_, keys_, values_ = on
        o = torch.zeros(B, R, H, d, device="cuda", dtype=dtype)
        rows = (q_[:, :, T:], k_[:, :, T:], v_[:, :, T:], k_[:, :, :T], v_[:, :, :T])
        triton_kernels.class_token_attention_kernel(
            o, *rows, keys_, values_, length.cuda(), slots.cuda(), None, d**-0.5
        )
        assert max_diff(o.float().cpu(), expected) <= bound, (tiles, R)


def test_shared_rows_read_through_a_stride_zero_view() -> None:
    B, H, T, R, d, S, P = 3, 2, 9, 4, 16, 5, 3
    q, k, v, keys, values, length, _ = _attention_inputs(B, H, T, R, d, S, P, seed=1)
    row = torch.tensor([3, 1, 0, 4])
    shared, full = torch.zeros(B, T + R, H, d), torch.zeros(B, T + R, H, d)
    rows = (q[:, :, T:], k[:, :, T:], v[:, :, T:], k[:, :, :T], v[:, :, :T])
    triton_kernels.class_token_attention_kernel(
        shared[:, T:], *rows, keys, values, length, row.expand(B, R), None, 0.25
    )
    triton_kernels.class_token_attention_kernel(
        full[:, T:], *rows, keys, values, length, row.repeat(B, 1), None, 0.25
    )
    assert torch.equal(shared, full)


def test_gathered_heads_kernel_equals_the_torch_heads() -> None:
    g = torch.Generator().manual_seed(0)
    S, C, D, M = 4, 130, 160, 9  # two class tiles, two width chunks
    weight, bias = torch.randn(S, C, D, generator=g), torch.randn(S, C, generator=g)
    c = torch.randn(M, D, generator=g)
    rows, slots = torch.tensor([0, 8, 3, 3, 5]), torch.tensor([1, 1, 3, 0, 2])
    out = triton_kernels.gathered_heads(c, rows, slots, weight, bias)
    assert max_diff(out, gathered_heads(c, rows, slots, weight, bias)) <= 1e-4
    assert max_diff(out[2], c[3] @ weight[3].T + bias[3]) <= 1e-4


@pytest.mark.parametrize(
    ("B", "R", "C", "D"), [(3, 4, 7, 64), (20, 3, 70, 80)]
)  # 1 tile; 2 image/class tiles
def test_shared_heads_kernel_reads_each_head_in_place_and_equals_the_torch_heads(B, R, C, D) -> None:
    g = torch.Generator().manual_seed(1)
    S = 6
    weight, bias = torch.randn(S, C, D, generator=g), torch.randn(S, C, generator=g)
    z = torch.randn(B, 5 + R, D, generator=g)
    c = z[:, 5:]  # the class-token rows are a view of the block's tokens, as in a pass
    slots = torch.tensor([4, 0, 2, 5][:R] + [1] * max(0, R - 4))
    out = triton_kernels.shared_heads(c, slots, weight, bias)  # (R, B, C)
    empty = torch.zeros(S, 1)
    pools = SlotPools(empty, empty, empty, empty, empty, weight, bias, generation=0)
    assert max_diff(out, shared_heads(c, pools, slots)) <= 1e-4
    assert max_diff(out[2, 1], c[1, 2] @ weight[2].T + bias[2]) <= 1e-4


def test_kernels_refuse_cpu_tensors_outside_the_interpreter(monkeypatch) -> None:
    monkeypatch.setattr(triton_kernels, "InterpretedFunction", type(None))  # as if compiled
    index = torch.zeros(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        triton_kernels.gathered_heads(torch.zeros(1, 16), index, index, torch.zeros(1, 2, 16), index.float())
