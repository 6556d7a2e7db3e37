"""One transformer block, split into the base tokens' path and the adapter class tokens' path.

The base tokens X go through the timm block exactly as timm computes it (same modules,
same ops, same attention kernel), which also yields their keys and values. The K adapter class
tokens C go through the same per-token modules; only their attention differs: class token k
attends over the shared base keys, the class tokens of its own lineage (itself, plus its ancestors
in extension mode) and its memory, whose keys and values are constants (docs/design.md §2.2).

Nothing here allocates a (T+K) x (T+K) mask, and the base path never sees adapter tokens, which is
what keeps the base logits timm's: in the merged inference path (block/merged.py) the base rows
share each linear layer's GEMM with the class-token rows, which can change float rounding but not
the result beyond it (the tests hold base logits to timm's within 1e-5 in float32; docs/design.md §2.6).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from timm.layers import Attention
from timm.models.vision_transformer import Block
from torch import Tensor


@dataclass(frozen=True)
class LayerMemory:
    """What adapter class tokens attend to besides the base tokens, for one layer.

    ``keys``/``values`` hold each adapter's visible memory (its own, plus its ancestors' in extension
    mode), padded to the longest with ``bias`` = -inf on padding; P is 0 when no adapter has memory.
    ``lineage`` lists, per adapter, the class tokens it attends to (itself first, then its ancestors),
    padded with ``lineage_bias`` = -inf; in concatenation mode A is 1 and each row is just itself.
    ``inputs``, when training keeps them, are the rows the memory keys and values are projected from
    (its normed memory, padded alike): what the written-out block of memory_core/stored/cached_block.py reads.
    """

    keys: Tensor  # (K, H, P, d)
    values: Tensor  # (K, H, P, d)
    bias: Tensor  # (K, P) additive 0 / -inf
    lineage: Tensor  # (K, A) long indices into the K class tokens
    lineage_bias: Tensor  # (K, A) additive 0 / -inf
    inputs: Tensor | None = None  # (K, P, D)


class BaseKeys(Protocol):
    """One layer's base tokens as the adapter class tokens read them. The fused pass holds their keys
    and values (``KeysValues``); training from cached activations may hold only the normed layer
    inputs they are projected from (memory_core/stored/cached.py)."""

    def attend(self, attn: Attention, q: Tensor, other: Tensor) -> tuple[Tensor, Tensor]:
        """Scaled class-token queries (B, H, K, d) and their scores on the other keys they read
        (lineage and memory, (B, H, K, S)) -> the weighted sum of the base values (B, H, K, d) and
        the weights of the other keys (B, H, K, S), from one softmax over [base keys ; other keys]."""
        ...


def softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    """Adapter softmaxes run in at least float32: bf16 scores over ~200 keys lose too much, and a
    float64 engine should be float64-accurate."""
    return torch.promote_types(dtype, torch.float32)


@dataclass(frozen=True)
class KeysValues:
    """The base tokens' keys and values, each (B, H, T, d). Stored ones (memory_core/stored/) override
    only the two products, to widen float16/bfloat16 storage where it is read."""

    keys: Tensor
    values: Tensor

    def attend(self, attn: Attention, q: Tensor, other: Tensor) -> tuple[Tensor, Tensor]:
        T = self.keys.shape[-2]
        scores = torch.cat([self.scores(q), other], dim=-1)  # (B, H, K, T + S)
        probs = attn.attn_drop(scores.softmax(dim=-1, dtype=softmax_dtype(q.dtype)).to(q.dtype))
        return self.weighted(probs[..., :T]), probs[..., T:]

    def scores(self, q: Tensor) -> Tensor:
        """Scaled queries (B, H, K, d) -> their scores on the base keys (B, H, K, T)."""
        return q @ self.keys.transpose(-2, -1)

    def weighted(self, p: Tensor) -> Tensor:
        """Weights on the base keys (B, H, K, T) -> the weighted sum of the base values (B, H, K, d)."""
        return p @ self.values


def project_qkv(attn: Attention, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Normalised tokens (B, N, D) -> q, k, v, each (B, H, N, d), as timm's Attention does."""
    B, N, _ = h.shape
    qkv = attn.qkv(h).reshape(B, N, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    return attn.q_norm(q), attn.k_norm(k), v


def memory_rows(block: Block, memory: Tensor, memory_norm: str) -> Tensor:
    """One layer's memory tokens (m, D) -> the rows (m, D) its keys and values are projected from:
    through the block's pre-attention LayerNorm (``memory_norm`` "norm1", the paper) or as they are."""
    return block.norm1(memory) if memory_norm == "norm1" else memory


def project_memory(block: Block, memory: Tensor, memory_norm: str) -> tuple[Tensor, Tensor]:
    """One layer's memory tokens (m, D) -> their keys and values, each (H, m, d).

    Memory tokens are keys and values only, so their queries are never computed.
    """
    _, k, v = project_qkv(block.attn, memory_rows(block, memory, memory_norm).unsqueeze(0))
    return k[0], v[0]


def base_attention(attn: Attention, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Self-attention of the base tokens, with timm's own choice of kernel. Returns (B, H, T, d)."""
    if attn.fused_attn:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=attn.attn_drop.p if attn.training else 0.0)
    scores = (q * attn.scale) @ k.transpose(-2, -1)
    return attn.attn_drop(scores.softmax(dim=-1)) @ v


def lineage_keys_values(k_c: Tensor, v_c: Tensor, memory: LayerMemory) -> tuple[Tensor, Tensor]:
    """The class-token keys and values k_c, v_c (B, H, K, d) -> each row's lineage's, (B, H, K, A, d):
    itself first, then its ancestors (extension mode); padding entries point at a real row, and the
    caller masks them with ``memory.lineage_bias``. Shared lineage (K, A) or routed (B, K, A)."""
    if memory.lineage.shape[-1] == 1:  # concatenation mode: each row's lineage is itself, no gather
        return k_c.unsqueeze(3), v_c.unsqueeze(3)
    if memory.lineage.ndim == 2:  # shared by every image
        return k_c[:, :, memory.lineage], v_c[:, :, memory.lineage]
    images = torch.arange(k_c.shape[0], device=k_c.device)[:, None, None]
    k_l = k_c.transpose(1, 2)[images, memory.lineage].permute(0, 3, 1, 2, 4)  # (B, H, K, A, d)
    v_l = v_c.transpose(1, 2)[images, memory.lineage].permute(0, 3, 1, 2, 4)
    return k_l, v_l


def class_token_attention(
    attn: Attention,
    q_c: Tensor,
    k_c: Tensor,
    v_c: Tensor,
    base: BaseKeys,
    memory: LayerMemory,
) -> Tensor:
    """Attention of the K adapter class tokens. q_c, k_c, v_c: (B, H, K, d); ``base``: the T base
    tokens of each image (their keys and values (B, H, T, d), or what they are projected from).

    One softmax per class token over [base keys ; lineage class-token keys ; memory keys].
    ``memory`` is shared by every image (keys (K, H, P, d), lineage (K, A): every adapter's row in
    every image) or routed (keys (B, K, H, P, d), lineage (B, K, A): row k of image b is whichever
    adapter the plan put there, memory_core/routing/plan.py). Returns (B, H, K, d).
    """
    A = memory.lineage.shape[-1]
    q = q_c * attn.scale
    shared = memory.lineage.ndim == 2  # else routed: rows differ per image
    k_l, v_l = lineage_keys_values(k_c, v_c, memory)  # (B, H, K, A, d)
    if A == 1:  # concatenation mode: each row's lineage is itself alone, never padding
        lineage_bias = None
    elif shared:
        lineage_bias = memory.lineage_bias  # (K, A)
    else:
        lineage_bias = memory.lineage_bias[:, None]  # (B, 1, K, A)
    if shared:
        m_scores = torch.einsum("bhkd,khpd->bhkp", q, memory.keys) + memory.bias  # bias (K, P)
    else:
        m_scores = torch.einsum("bhkd,bkhpd->bhkp", q, memory.keys) + memory.bias[:, None]  # (B, 1, K, P)
    l_scores = (q.unsqueeze(3) * k_l).sum(-1)  # (B, H, K, A)
    if lineage_bias is not None:
        l_scores = l_scores + lineage_bias
    other = torch.cat([l_scores, m_scores], dim=-1)  # (B, H, K, A+P)
    # Every class token reads its image's base tokens; one softmax over those and the others.
    o_x, p_other = base.attend(attn, q, other)
    p_l, p_m = p_other[..., :A], p_other[..., A:]
    if shared:
        o_m = torch.einsum("bhkp,khpd->bhkd", p_m, memory.values)
    else:
        o_m = torch.einsum("bhkp,bkhpd->bhkd", p_m, memory.values)
    return o_x + (p_l.unsqueeze(-1) * v_l).sum(3) + o_m  # (B, H, K, d)


def _finish(block: Block, x: Tensor, h: Tensor | None, o: Tensor) -> Tensor:
    """Everything after attention, per token: output projection, layer scale, residual, MLP.

    x: the block input (B, N, D); h: norm1(x) (read only by a gated attention); o: attention output
    with heads merged (B, N, H*d).
    """
    attn = block.attn
    o = attn.norm(o)
    gate = getattr(attn, "gate", None)
    if gate is not None:
        o = o * gate(h).sigmoid()
    o = attn.proj_drop(attn.proj(o))
    x = x + block.drop_path1(block.ls1(o))
    return x + block.drop_path2(block.ls2(block.mlp(block.norm2(x))))


def _merge_heads(o: Tensor) -> Tensor:
    """(B, H, N, d) -> (B, N, H*d)."""
    B, _, N, _ = o.shape
    return o.transpose(1, 2).reshape(B, N, -1)


def base_block(block: Block, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Base tokens x (B, T, D) through one block, as timm computes it.

    Returns the block's output and what the class tokens read of this layer: the normed input
    h = norm1(x) (B, T, D) and the keys and values (B, H, T, d) projected from it. The split path and
    the activation cache (memory_core/stored/cached.py) both run the base through here, so a cache holds
    exactly what the split path would have computed.
    """
    h = block.norm1(x)
    q, k, v = project_qkv(block.attn, h)  # (B, H, T, d) each
    o = base_attention(block.attn, q, k, v)
    return _finish(block, x, h, _merge_heads(o)), h, k, v


def class_token_block(block: Block, c: Tensor, base: BaseKeys, memory: LayerMemory) -> Tensor:
    """Adapter class tokens c (B, K, D) through one block, reading the base tokens as ``base``."""
    h_c = block.norm1(c)
    q_c, k_c, v_c = project_qkv(block.attn, h_c)  # (B, H, K, d) each
    o_c = class_token_attention(block.attn, q_c, k_c, v_c, base, memory)
    return _finish(block, c, h_c, _merge_heads(o_c))


def split_block(block: Block, x: Tensor, c: Tensor, memory: LayerMemory) -> tuple[Tensor, Tensor]:
    """Base tokens x (B, T, D) and adapter class tokens c (B, K, D) through one block, apart.

    The training path (docs/design.md §2.3): x never meets a tensor that needs gradients, so autograd records
    only the class-token rows and back-propagation costs about one inference pass.
    """
    x_out, _, k_x, v_x = base_block(block, x)
    return x_out, class_token_block(block, c, KeysValues(k_x, v_x), memory)
