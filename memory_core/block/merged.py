"""Base tokens and adapter class tokens through one block together: the inference path.

z = [X ; C] (B, T+K, D): every per-token module (norms, qkv, projection, MLP) runs once over all
T+K rows, one GEMM per linear layer instead of a large one and a thin one; only attention is split
(docs/design.md §2.1). Row i of a GEMM does not depend on the other rows, so the base rows are
still computed as ``block(x)`` computes them, up to the GEMM's rounding (docs/design.md §2.6).

On the CPU, with timm's fused attention, every row's queries go through the base's own attention
kernel over the T base keys, which also returns each row's log-sum-exp; a class-token row then
needs only its lineage and memory scores and one softmax over [log-sum-exp ; those], never a copy of
the base keys or values nor of the attention output (they cost as much as the rows' whole attention
at width 192). Elsewhere the rows' attention reads the base keys and values directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from timm.layers import Attention
from timm.models.vision_transformer import Block
from torch import Tensor

from .attention import (
    KeysValues,
    LayerMemory,
    _finish,
    base_attention,
    class_token_attention,
    project_qkv,
    softmax_dtype,
)


@dataclass(frozen=True)
class BaseSummary:
    """The base tokens as each class-token row sees them, summarised by the base's attention kernel:
    the row's attention output over the base keys alone (normalised) and the log of that softmax's
    denominator. One softmax over [log-sum-exp ; other scores] then weighs the base part and the
    other keys exactly as one softmax over [base keys ; other keys] would."""

    output: Tensor  # (B, H, K, d)
    logsumexp: Tensor  # (B, H, K), float32 for 16-bit engines

    def attend(self, attn: Attention, q: Tensor, other: Tensor) -> tuple[Tensor, Tensor]:
        dtype = torch.promote_types(self.logsumexp.dtype, softmax_dtype(q.dtype))
        scores = torch.cat([self.logsumexp.unsqueeze(-1).to(dtype), other.to(dtype)], dim=-1)
        # The softmax of a few scores per row, spelt out: torch's softmax kernel splits even a tensor
        # this small across threads, and a parallel region waits for a busy core; these don't.
        e = (scores - scores.amax(dim=-1, keepdim=True)).exp()
        probs = (e / e.sum(dim=-1, keepdim=True)).to(q.dtype)  # (B, H, K, 1 + S)
        return probs[..., :1] * self.output, probs[..., 1:]


def summarised(attn: Attention, z: Tensor) -> bool:
    """Whether this block's rows take the CPU's one-kernel route: timm's fused attention on the CPU,
    and nothing to differentiate (the kernel's log-sum-exp carries no gradient) nor drop."""
    return (
        z.device.type == "cpu"
        and attn.fused_attn
        and not (attn.training and attn.attn_drop.p > 0)
        and not (torch.is_grad_enabled() and z.requires_grad)
    )


def merged_block(block: Block, z: Tensor, num_base: int, memory: LayerMemory) -> Tensor:
    """Base tokens and adapter class tokens, z = [X ; C] (B, T+K, D), through one block."""
    T = num_base
    attn = block.attn
    h = block.norm1(z)
    q, k, v = project_qkv(attn, h)  # (B, H, T+K, d) each
    B, H, N, d = q.shape
    k_x, v_x = k[:, :, :T], v[:, :, :T]
    if summarised(attn, z):
        # Every row over the base keys in one kernel, the output in the block's (B, N, H, d) layout.
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k_x, v_x, scale=attn.scale)
        o = o.transpose(1, 2)  # (B, N, H, d)
        if not o.is_contiguous():
            o = o.contiguous()
        base = BaseSummary(o[:, T:].transpose(1, 2), lse[:, :, T:])
        o_c = class_token_attention(attn, q[:, :, T:], k[:, :, T:], v[:, :, T:], base, memory)
        o[:, T:] = o_c.transpose(1, 2)  # the class-token rows, in place: (B, K, H, d)
        del q, k, v, k_x, v_x, o_c, base
        return _finish(block, z, h, o.view(B, N, H * d))
    o_x = base_attention(attn, q[:, :, :T], k_x, v_x)  # (B, H, T, d)
    o_c = class_token_attention(attn, q[:, :, T:], k[:, :, T:], v[:, :, T:], KeysValues(k_x, v_x), memory)
    del q, k, v, k_x, v_x  # drop this layer's keys and values before the MLP allocates its hidden layer
    o = torch.cat([o_x.transpose(1, 2), o_c.transpose(1, 2)], dim=1).flatten(2)  # (B, T+K, H*d)
    del o_x, o_c
    return _finish(block, z, h, o)


def class_rows_attention(
    attn: Attention, q: Tensor, k: Tensor, v: Tensor, k_x: Tensor, v_x: Tensor, memory: LayerMemory
) -> Tensor:
    """The class-token rows' attention when their q, k, v (B, H, R, d) are apart from the base keys
    and values k_x, v_x (B, H, T, d) (block/apart.py): on the CPU's route above, the base kernel's
    summary of the rows; else the base keys read directly. Returns (B, R, H, d)."""
    if summarised(attn, q):
        o_x, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k_x, v_x, scale=attn.scale)
        base = BaseSummary(o_x, lse)
    else:
        base = KeysValues(k_x, v_x)
    return class_token_attention(attn, q, k, v, base, memory).transpose(1, 2)
