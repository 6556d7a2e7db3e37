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

import torch
from timm.layers import Attention, Mlp
from timm.models.vision_transformer import Block
from torch import Tensor, nn

from .attention import (
    KeysValues,
    LayerMemory,
    _finish,
    base_attention,
    class_token_attention,
    lineage_keys_values,
    project_qkv,
    softmax_dtype,
)


def summary_attention(
    attn: Attention, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, memory: LayerMemory
) -> None:
    """The class-token rows' attention from the base kernel's summary of them, written into ``o``.

    q, k, v: the rows' (B, H, R, d); ``o`` (B, R, H, d): on entry each row's attention output over
    the base keys alone (normalised), on return the row's whole attention output; ``lse`` (B, H, R):
    the log of that softmax's denominator. One softmax over [lse ; lineage scores ; memory scores]
    weighs the base part and the other keys exactly as one softmax over [base keys ; other keys]
    would. Written for the CPU's two threads: every operation over (B, H, R, d) elements opens a
    parallel region, which on a shared machine waits for the other core, so the rows' values are
    accumulated into ``o`` in place (scale, then add) and nothing is concatenated at that size; only
    the few scores per row are.
    """
    A = memory.lineage.shape[-1]
    shared = memory.lineage.ndim == 2  # else routed: (B, R, ...) rows
    dtype = torch.promote_types(lse.dtype, softmax_dtype(q.dtype))
    if A == 1:  # concatenation mode: each row's lineage is itself
        v_l = None
        l_scores = (q * k).sum(-1, keepdim=True)  # (B, H, R, 1)
    else:
        k_l, v_l = lineage_keys_values(k, v, memory)  # (B, H, R, A, d)
        l_scores = (q.unsqueeze(3) * k_l).sum(-1)  # (B, H, R, A)
    m_scores = torch.einsum("bhkd,khpd->bhkp" if shared else "bhkd,bkhpd->bhkp", q, memory.keys)
    bias = torch.cat([memory.lineage_bias, memory.bias], dim=-1)  # (R, A+P), routed (B, R, A+P)
    other = torch.cat([l_scores, m_scores], dim=-1).to(dtype) * attn.scale  # (B, H, R, A+P)
    other = other + (bias if shared else bias.unsqueeze(1))
    scores = torch.cat([lse.unsqueeze(-1).to(dtype), other], dim=-1)  # (B, H, R, 1+A+P)
    # The softmax of a few scores per row, spelt out: torch's softmax kernel splits even a tensor
    # this small across threads; these don't.
    e = (scores - scores.amax(dim=-1, keepdim=True)).exp()
    p = (e / e.sum(dim=-1, keepdim=True)).to(q.dtype).transpose(1, 2)  # (B, R, H, 1+A+P), as o
    o.mul_(p[..., :1])  # the base part
    if v_l is None:
        o.addcmul_(p[..., 1:2], v.transpose(1, 2))
    else:
        o.add_((p[..., 1 : 1 + A].unsqueeze(-1) * v_l.transpose(1, 2)).sum(3))
    values = memory.values  # (R, H, P, d) shared, (B, R, H, P, d) routed
    p_m = p[..., 1 + A :]  # (B, R, H, P)
    if values.shape[-2] == 1:  # one memory entry: a scaled add, no product
        o.addcmul_(p_m, values[..., 0, :])
    else:
        o.add_(torch.einsum("bkhp,khpd->bkhd" if shared else "bkhp,bkhpd->bkhd", p_m, values))


def base_summary(attn: Attention, q: Tensor, k_x: Tensor, v_x: Tensor) -> tuple[Tensor, Tensor]:
    """Queries (B, H, N, d) over the base keys and values (B, H, T, d) in the CPU's flash kernel:
    the output (B, H, N, d), laid out as (B, N, H, d), and each row's log-sum-exp (B, H, N)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k_x, v_x, scale=attn.scale)


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
    h, o = _attend(block, z, num_base, memory)
    return _finish(block, z, h, o)


def _attend(block: Block, z: Tensor, num_base: int, memory: LayerMemory) -> tuple[Tensor, Tensor]:
    """The block's first norm h (B, T+K, D) and every row's attention output o (B, T+K, H*d),
    before the projection: base rows over the base keys, class-token rows over those, themselves
    and their memory."""
    T = num_base
    attn = block.attn
    h = block.norm1(z)
    q, k, v = project_qkv(attn, h)  # (B, H, T+K, d) each
    B, H, N, d = q.shape
    k_x, v_x = k[:, :, :T], v[:, :, :T]
    if summarised(attn, z):
        # Every row over the base keys in one kernel, the output in the block's (B, N, H, d) layout.
        o, lse = base_summary(attn, q, k_x, v_x)
        o = o.transpose(1, 2)  # (B, N, H, d)
        if not o.is_contiguous():
            o = o.contiguous()
        # The class-token rows' output, in place over their base part: (B, K, H, d).
        summary_attention(attn, q[:, :, T:], k[:, :, T:], v[:, :, T:], o[:, T:], lse[:, :, T:], memory)
    else:
        o_x = base_attention(attn, q[:, :, :T], k_x, v_x)  # (B, H, T, d)
        o_c = class_token_attention(attn, q[:, :, T:], k[:, :, T:], v[:, :, T:], KeysValues(k_x, v_x), memory)
        del q, k, v, k_x, v_x  # drop this layer's keys and values before the output's copy
        o = torch.cat([o_x.transpose(1, 2), o_c.transpose(1, 2)], dim=1)  # (B, N, H, d)
    return h, o.view(B, N, H * d)  # q, k, v freed on return, before the MLP allocates its hidden layer


def merged_last_block(block: Block, z: Tensor, num_base: int, memory: LayerMemory, read: int) -> Tensor:
    """``merged_block`` for the last block when only the first ``read`` base rows are read after it
    (timm's token pooling reads the class token, a distilled DeiT its distillation token too): every
    row's keys, values and attention, but projection and MLP for [X[:, :read] ; C] alone. Returns
    those rows, (B, read + K, D).

    The other base rows' outputs, which nothing reads, are never computed (for ViT-B/32, 49 of 50
    base rows of the last block's projection and MLP: about 5% of the pass). The rows kept go
    through per-image products (``per_image``): one (read + K)-row product per image, never one
    over every image's rows, whose split across threads rounds a row by where it sits (two threads
    on a CPU: two identical images in one pass ~3e-7 apart). Attention runs over every query, as in
    ``merged_block``, for the same reason. Needs timm's plain Mlp and no gate (``trimmable``).
    """
    T = num_base
    attn = block.attn
    _, o = _attend(block, z, T, memory)  # (B, T+K, H*d)
    rows = torch.cat([z[:, :read], z[:, T:]], dim=1)  # (B, read + K, D)
    o = torch.cat([o[:, :read], o[:, T:]], dim=1)
    mlp = block.mlp
    x = rows + block.drop_path1(block.ls1(attn.proj_drop(per_image(attn.proj, attn.norm(o)))))
    f = mlp.norm(mlp.drop1(mlp.act(per_image(mlp.fc1, block.norm2(x)))))
    return x + block.drop_path2(block.ls2(mlp.drop2(per_image(mlp.fc2, f))))


def trimmable(block: Block) -> bool:
    """Whether ``merged_last_block`` computes this block: no gate after attention, timm's plain Mlp
    and linear products (it runs them per image)."""
    mlp = block.mlp
    return (
        getattr(block.attn, "gate", None) is None
        and type(mlp) is Mlp
        and all(isinstance(m, nn.Linear) for m in (block.attn.proj, mlp.fc1, mlp.fc2))
    )


def per_image(linear: nn.Linear, x: Tensor) -> Tensor:
    """``linear`` over x (B, r, in), one product per image (a batched product over the images):
    (B, r, out). Each image's rows come out the same wherever the image sits in the batch."""
    B, r, _ = x.shape
    weight = linear.weight.t().expand(B, *linear.weight.t().shape)  # (B, in, out), no copy
    if linear.bias is None:
        return torch.bmm(x, weight)
    return torch.baddbmm(linear.bias.expand(B, r, linear.out_features), x, weight)


def class_rows_attention(
    attn: Attention, q: Tensor, k: Tensor, v: Tensor, k_x: Tensor, v_x: Tensor, memory: LayerMemory
) -> Tensor:
    """The class-token rows' attention when their q, k, v (B, H, R, d) are apart from the base keys
    and values k_x, v_x (B, H, T, d) (block/apart.py): on the CPU's route above, the base kernel's
    summary of the rows; else the base keys read directly. Returns (B, R, H, d)."""
    if summarised(attn, q):
        o_x, lse = base_summary(attn, q, k_x, v_x)
        o = o_x.transpose(1, 2)  # (B, R, H, d)
        summary_attention(attn, q, k, v, o, lse, memory)
        return o
    return class_token_attention(attn, q, k, v, KeysValues(k_x, v_x), memory).transpose(1, 2)
