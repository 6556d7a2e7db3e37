"""A frozen attention's projections folded together, for the class-token path of training from a cache.

A class token's query q_h = W_q,h x + b_q,h (head h) only ever meets the base through keys and
values that are affine in normed inputs r (base tokens, itself and its memory alike):
k = W_k,h r + b_k,h, v = W_v,h r + b_v,h. So, with s the attention scale,

    s q_h.k    = u_h.r + s q_h.b_k,h     u_h = s W_k,h^T W_q,h x + s W_k,h^T b_q,h     (D,)
    out proj   = sum_h W_o,h sum_r p_r v_r + b_o = sum_h (W_o,h W_v,h) (sum_r p_r r) + (W_o b_v + b_o)

The term s q_h.b_k,h is the same for every key a query reads, and softmax ignores a constant shift,
so it is dropped; sum_r p_r = 1 turns the value bias into a constant. What is left is one linear
layer into the H query rows u (``query_key``, (H*D, D)), the products with the rows r, and one
linear layer out of the H weighted sums (``value_out``, (D, H*D)): two GEMMs where the unfolded
block runs the qkv and output projections plus four per-head products, and every row of a class
token's attention (base, itself, memory) is handled alike. The folds are computed in float64 and
cast, so they round once; ``folded`` keeps them for as long as the attention's tensors are the
same, unchanged ones (storage, version counter, dtype and device).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from timm.layers import Attention
from torch import Tensor


@dataclass(frozen=True)
class FoldedAttention:
    """One attention's query-key and value-output products, head by head along H*D."""

    query_key: Tensor  # (H*D, D): x -> the H rows u_h, the scale included
    query_key_bias: Tensor | None  # (H*D,)
    value_out: Tensor  # (D, H*D): the H weighted sums of rows -> the attention's output
    value_out_bias: Tensor | None  # (D,)


_cache: weakref.WeakKeyDictionary[Attention, tuple[tuple, FoldedAttention]] = weakref.WeakKeyDictionary()


def folded(attn: Attention) -> FoldedAttention:
    """``attn`` folded (module doc), reused while its weights are unchanged. The base must be frozen:
    the folds are constants of a training step's graph."""
    tensors = [t for t in (attn.qkv.weight, attn.qkv.bias, attn.proj.weight, attn.proj.bias) if t is not None]
    if any(t.requires_grad for t in tensors):
        raise ValueError("the cached path trains adapters over a frozen base; this base requires grad")
    key = tuple((t.data_ptr(), t._version, t.dtype, t.device) for t in tensors)
    hit = _cache.get(attn)
    if hit is None or hit[0] != key:
        hit = (key, _fold(attn))
        _cache[attn] = hit
    return hit[1]


@torch.no_grad()
def _fold(attn: Attention) -> FoldedAttention:
    H, d, A = attn.num_heads, attn.head_dim, attn.attn_dim
    weight = attn.qkv.weight
    dtype, wide = weight.dtype, torch.float64
    D = weight.shape[1]
    w_q, w_k, w_v = weight.to(wide).view(3, H, d, D).unbind(0)  # each (H, d, D)
    query_key = (attn.scale * w_k.transpose(1, 2) @ w_q).reshape(H * D, D)
    w_o = attn.proj.weight.to(wide)  # (D, A)
    value_out = (w_o.view(D, H, d).transpose(0, 1) @ w_v).transpose(0, 1).reshape(D, H * D)
    query_key_bias = value_out_bias = None
    if attn.qkv.bias is not None:
        b_q, _, b_v = attn.qkv.bias.to(wide).view(3, H, d).unbind(0)
        query_key_bias = (attn.scale * (w_k.transpose(1, 2) @ b_q[..., None])).reshape(H * D)
        value_out_bias = w_o @ b_v.reshape(A)
    if attn.proj.bias is not None:
        proj_bias = attn.proj.bias.to(wide)
        value_out_bias = proj_bias if value_out_bias is None else value_out_bias + proj_bias

    def cast(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.to(dtype)

    return FoldedAttention(cast(query_key), cast(query_key_bias), cast(value_out), cast(value_out_bias))
