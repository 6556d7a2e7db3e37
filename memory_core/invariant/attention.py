"""The class token's attention in the batch-invariant mode: the torch attention's maths
(block/attention.py) with every reduction in calls whose shapes depend on neither the batch nor the
adapter set, so a row's result depends on that row alone (the rules in invariant/mode.py)."""

from __future__ import annotations

import torch
from timm.layers import Attention
from torch import Tensor

from ..block.attention import LayerMemory, lineage_keys_values
from .blocks import InvariantBlocks, fixed_bmm, in_blocks, pad_up


def invariant_class_token_attention(
    attn: Attention,
    q_c: Tensor,
    k_c: Tensor,
    v_c: Tensor,
    k_x: Tensor,
    v_x: Tensor,
    memory: LayerMemory,
    blocks: InvariantBlocks,
) -> Tensor:
    """``block.attention.class_token_attention`` computed so that a row's result depends on that row alone.

    q_c, k_c, v_c: (B, H, K, d); k_x, v_x: (B, H, T, d). Returns (B, H, K, d).
    """
    B, H, K, d = q_c.shape
    T = k_x.shape[2]
    wide = torch.promote_types(q_c.dtype, torch.float32)  # the softmax's dtype, as in the default pass
    q = (q_c * attn.scale).to(wide)
    k_x, v_x = k_x.to(wide), v_x.to(wide)
    # Values with a column of ones: one product gives the weighted values and the weights' sum.
    v_x1 = torch.cat([v_x, v_x.new_ones(B, H, T, 1)], dim=-1)  # (B, H, T, d+1)
    k_xt = k_x.transpose(-2, -1).contiguous()  # (B, H, d, T)
    # Base keys: queries in fixed chunks of `thin` rows per image (K padded with zero queries).
    q_p = pad_up(q, 2, blocks.thin)
    chunks = range(0, q_p.shape[2], blocks.thin)
    s_x = torch.cat(
        [in_blocks(fixed_bmm, blocks.images, q_p[:, :, j : j + blocks.thin], k_xt) for j in chunks],
        dim=2,
    )[:, :, :K]  # (B, H, K, T)
    # Own keys (lineage, memory), one entry per class-token row (B*K), in fixed chunks of keys.
    top = _rows_first(s_x.amax(dim=-1, keepdim=True)).squeeze(-1)  # (B*K, H)
    q_rows = _rows_first(q).unsqueeze(-1)  # (B*K, H, d, 1)
    own = []  # per chunk: scores plus bias (B*K, H, c), values and a column of ones (B*K, H, c, d+1)
    for keys, values, bias in _own_keys(k_c, v_c, memory, B):
        c = blocks.keys
        keys, values, bias = (
            pad_up(keys, 2, c),
            pad_up(values, 2, c),
            pad_up(bias, 2, c, float("-inf")),
        )
        values = torch.cat([values, values.new_ones(*values.shape[:-1], 1)], dim=-1).to(wide)
        for j in range(0, keys.shape[2], c):
            s = in_blocks(fixed_bmm, blocks.batches, keys[:, :, j : j + c].to(wide), q_rows).squeeze(-1)
            s = s + bias[..., j : j + c]
            top = torch.maximum(top, s.amax(dim=-1))  # the max is exact in any order
            own.append((s, values[:, :, j : j + c]))
    # Softmax from its pieces: exponentials, and sums taken by the products of the weighted values.
    e_x = pad_up((s_x - _heads_first(top, B)[..., None]).exp(), 2, blocks.thin)
    o = torch.cat(
        [in_blocks(fixed_bmm, blocks.images, e_x[:, :, j : j + blocks.thin], v_x1) for j in chunks],
        dim=2,
    )[:, :, :K]  # (B, H, K, d+1)
    o = _rows_first(o)  # (B*K, H, d+1)
    for s, values in own:
        e = (s - top[..., None]).exp().unsqueeze(2)  # (B*K, H, 1, c); padding: exp(-inf) = 0 adds 0
        o = o + in_blocks(fixed_bmm, blocks.batches, e, values).squeeze(2)
    return _heads_first((o[..., :d] / o[..., d:]).to(q_c.dtype), B)


def _rows_first(t: Tensor) -> Tensor:
    """(B, H, K, ...) -> (B*K, H, ...): one entry per class-token row, so rows can be blocked."""
    B, H, K = t.shape[:3]
    return t.transpose(1, 2).reshape(B * K, H, *t.shape[3:])


def _heads_first(t: Tensor, B: int) -> Tensor:
    """(B*K, H, ...) -> (B, H, K, ...), undoing ``_rows_first``."""
    return t.reshape(B, -1, *t.shape[1:]).transpose(1, 2)


def _own_keys(k_c: Tensor, v_c: Tensor, memory: LayerMemory, B: int) -> list[tuple[Tensor, Tensor, Tensor]]:
    """Per class-token row, its lineage's and its memory's keys and values (B*K, H, n, d) and the
    bias on them (B*K, 1, n): -inf on padding."""
    _, H, K, d = k_c.shape
    k_l, v_l = (t.transpose(1, 2) for t in lineage_keys_values(k_c, v_c, memory))  # (B, K, H, A, d)
    if memory.lineage.ndim == 2:  # shared by every image
        l_bias = memory.lineage_bias.expand(B, -1, -1)  # (B, K, A)
        k_m = memory.keys.expand(B, -1, -1, -1, -1)  # (K, H, P, d) -> (B, K, H, P, d)
        v_m = memory.values.expand(B, -1, -1, -1, -1)
        m_bias = memory.bias.expand(B, -1, -1)
    else:  # routed: row k of image b is adapter idx[b, k]
        l_bias, k_m, v_m, m_bias = memory.lineage_bias, memory.keys, memory.values, memory.bias
    k_l, v_l, k_m, v_m = (t.reshape(B * K, H, -1, d) for t in (k_l, v_l, k_m, v_m))
    return [(k_l, v_l, l_bias.reshape(B * K, 1, -1)), (k_m, v_m, m_bias.reshape(B * K, 1, -1))]
