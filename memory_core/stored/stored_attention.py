"""How adapter class tokens read one layer of cached base activations (memory_core/stored/cached.py).

- ``StoredKeysValues``: the "keys-values" store, the base keys and values themselves.
- ``NormedInputs``: the "inputs" store, the normed layer inputs h the keys and values are affine in
  (k = h W_k^T + b_k, v = h W_v^T + b_v), so a class token never needs the T keys themselves:
  q.k = (q W_k).h + q.b_k and p.v = (p h) W_v^T + (sum p) b_v. Its forward and backward passes are
  written out (``attend_inputs``, ``attend_inputs_backward``) as one autograd node for the generic
  path; the written-out block of memory_core/stored/cached_block.py goes further and folds the whole
  attention (memory_core/stored/folded_attention.py).

Both widen the stored layer (float16 or bfloat16 storage) to the queries' dtype where it is read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from timm.layers import Attention
from torch import Tensor

from ..block.attention import KeysValues, softmax_dtype


class _TimesStored(torch.autograd.Function):
    """``a @ x`` (or ``a @ x^T``) for a stored constant ``x``, widened to ``a``'s dtype where it is used.

    The backward pass widens ``x`` again instead of keeping the widened copy: per layer the copy is a
    few MB, made and read while it is still in cache, where a copy kept for the backward pass would
    come back from main memory (and the whole batch would stay allocated at twice its size). Reading
    the stored layers is most of a cached step's memory traffic.
    """

    @staticmethod
    def forward(ctx, a: Tensor, x: Tensor, transpose: bool) -> Tensor:
        ctx.save_for_backward(x)
        ctx.transpose = transpose
        wide = x.to(a.dtype)
        return a @ (wide.transpose(-1, -2) if transpose else wide)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        (x,) = ctx.saved_tensors
        wide = x.to(grad.dtype)
        return grad @ (wide if ctx.transpose else wide.transpose(-1, -2)), None, None


@dataclass(frozen=True)
class StoredKeysValues(KeysValues):
    """One layer's cached base keys and values, each (B, H, T, d) in the storage dtype: the attention
    of ``KeysValues``, its two products reading the stored layer widened where it is used."""

    def scores(self, q: Tensor) -> Tensor:
        return _TimesStored.apply(q, self.keys, True)

    def weighted(self, p: Tensor) -> Tensor:
        return _TimesStored.apply(p, self.values, False)


@dataclass(frozen=True)
class Folded:
    """A frozen attention's key and value projections, per head: W_k, W_v (H, d, D), b_k, b_v (H, 1, d)."""

    w_k: Tensor
    b_k: Tensor
    w_v: Tensor
    b_v: Tensor

    @classmethod
    def of(cls, attn: Attention, like: Tensor) -> Folded:
        H, d, width = attn.num_heads, attn.head_dim, attn.attn_dim
        w_k, w_v = attn.qkv.weight[width:].view(2, H, d, -1)
        bias = attn.qkv.bias
        b_k, b_v = like.new_zeros(2, H, 1, d) if bias is None else bias[width:].view(2, H, 1, d)
        if w_k.requires_grad:
            raise ValueError("the cached path trains adapters over a frozen base; this base requires grad")
        return cls(w_k, b_k, w_v, b_v)


def per_head(x: Tensor, w: Tensor) -> Tensor:
    """x (B, H, K, a) times w (H, a, b), head by head -> (B, H, K, b): ``einsum("bhka,hab->bhkb")``
    as one bmm over the heads, without einsum's planning on every call (a cached step makes hundreds)."""
    B, H, K, a = x.shape
    return torch.bmm(x.transpose(0, 1).reshape(H, B * K, a), w).view(H, B, K, -1).transpose(0, 1)


def attend_inputs(
    q: Tensor, other: Tensor, h: Tensor, f: Folded, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """Scaled queries q (B, H, K, d) and other scores (B, H, K, S) over the stored normed inputs h
    (B, T, D) -> the base part of the output (B, H, K, d) and ALL the weights p (B, H, K, T + S):

        scores = (q W_k).h + q.b_k             the query folded into W_k
        p      = softmax([scores ; other])     one softmax with the lineage and memory scores
        o      = (p h) W_v^T + (sum p) b_v     the weighted sum folded into W_v
    """
    B, H, K, _ = q.shape
    T = h.shape[1]
    wide = h.to(q.dtype)
    u = per_head(q, f.w_k).reshape(B, H * K, -1)  # (B, H*K, D)
    scores = torch.bmm(u, wide.transpose(1, 2)).view(B, H, K, T) + (q * f.b_k).sum(-1, keepdim=True)
    p = torch.cat([scores, other], dim=-1).softmax(dim=-1, dtype=dtype).to(q.dtype)
    p_x = p[..., :T]
    ph = torch.bmm(p_x.reshape(B, H * K, T), wide).view(B, H, K, -1)  # (B, H, K, D)
    return per_head(ph, f.w_v.transpose(1, 2)) + p_x.sum(-1, keepdim=True) * f.b_v, p


def attend_inputs_backward(
    grad_o: Tensor, grad_other: Tensor, q: Tensor, h: Tensor, p: Tensor, f: Folded, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """``attend_inputs`` backward: the gradients of its output (B, H, K, d) and of the other weights
    p[..., T:] -> those of q (B, H, K, d) and of the other scores (B, H, K, S)."""
    B, H, K, _ = q.shape
    T = h.shape[1]
    wide = h.to(q.dtype)
    grad_ph = per_head(grad_o, f.w_v).reshape(B, H * K, -1)
    grad_p = torch.empty_like(p)
    grad_p[..., :T] = torch.bmm(grad_ph, wide.transpose(1, 2)).view(B, H, K, T)
    grad_p[..., :T] += (grad_o * f.b_v).sum(-1, keepdim=True)
    grad_p[..., T:] = grad_other
    pw, gw = p.to(dtype), grad_p.to(dtype)
    grad_s = (pw * (gw - (gw * pw).sum(-1, keepdim=True))).to(q.dtype)  # through the softmax
    grad_x = grad_s[..., :T]
    grad_u = torch.bmm(grad_x.reshape(B, H * K, T), wide).view(B, H, K, -1)
    grad_q = per_head(grad_u, f.w_k.transpose(1, 2)) + grad_x.sum(-1, keepdim=True) * f.b_k
    return grad_q, grad_s[..., T:]


class _AttendInputs(torch.autograd.Function):
    """``attend_inputs`` as one autograd node: h is widened once per pass and read twice while it is
    still in cache, and none of the small steps in between records a node (about 30 fewer per layer
    and step). The base is frozen: only q and the other scores get gradients."""

    @staticmethod
    def forward(ctx, q: Tensor, other: Tensor, h: Tensor, f: Folded, dtype) -> tuple[Tensor, Tensor]:
        o, p = attend_inputs(q, other, h, f, dtype)
        ctx.save_for_backward(q, h, p)
        ctx.folded, ctx.dtype = f, dtype
        return o, p[..., h.shape[1] :]

    @staticmethod
    def backward(ctx, grad_o: Tensor, grad_other: Tensor) -> tuple[Tensor | None, ...]:
        q, h, p = ctx.saved_tensors
        grad_q, grad_s = attend_inputs_backward(grad_o, grad_other, q, h, p, ctx.folded, ctx.dtype)
        return grad_q, grad_s, None, None, None


@dataclass(frozen=True)
class NormedInputs:
    """One layer's base tokens held as their normed inputs h (B, T, D), in the storage dtype."""

    h: Tensor

    def attend(self, attn: Attention, q: Tensor, other: Tensor) -> tuple[Tensor, Tensor]:
        return _AttendInputs.apply(q, other, self.h, Folded.of(attn, q), softmax_dtype(q.dtype))
