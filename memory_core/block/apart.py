"""Base tokens and class tokens through one block with their matrix products apart.

    z = [every image's T base rows ; every image's R class-token rows]   (B*T + B*R, D), flat

The per-token modules that are not products (norms, residual adds, layer scale, the MLP's
activation) run once over every row, as in the merged block (block/merged.py); each linear layer is
two products, the base rows' on exactly the base pass's shape (B*T rows) and the class-token rows'
on their own (B*R rows), writing the two halves of one output: nothing is copied. The base rows
are so computed as timm computes them, op for op and shape for shape: their logits are timm's bit
for bit. Why an option and not the rule: a GPU's GEMM library picks its tiles by the row count, and
B*(T+R) rows may get slower tiles than B*T (ViT-B/16 in bfloat16 on an H200: +12% GEMM time for 4%
more rows), against which stands a second, thin product per linear layer (docs/design.md §2.10).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from timm.layers import Attention, Mlp
from timm.models.vision_transformer import Block
from torch import Tensor, nn

from .attention import base_attention

# The class-token rows' attention: (attn, q, k, v of the rows (B, H, R, d), base keys and values
# (B, H, T, d)) -> the rows' output (B, R, H, d).
RowAttention = Callable[[Attention, Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


def apart_supported(block: Block) -> bool:
    """Whether ``apart_block`` computes this block as timm does: timm's Attention without a gate and
    its plain Mlp (no gated or fused variant), every product an ``nn.Linear``."""
    attn, mlp = block.attn, block.mlp
    return (
        type(attn) is Attention
        and getattr(attn, "gate", None) is None
        and type(mlp) is Mlp
        and all(isinstance(m, nn.Linear) for m in (attn.qkv, attn.proj, mlp.fc1, mlp.fc2))
    )


def products_apart(linear: nn.Linear, base_rows: Tensor, class_rows: Tensor) -> Tensor:
    """``linear`` over (n, in) base rows and (r, in) class-token rows: two products, as ``F.linear``
    computes each (``addmm`` over the rows), into the halves of one (n + r, out) tensor."""
    n = base_rows.shape[0]
    out = base_rows.new_empty(n + class_rows.shape[0], linear.out_features)
    weight = linear.weight.t()
    for rows, into in ((base_rows, out[:n]), (class_rows, out[n:])):
        if linear.bias is None:
            torch.mm(rows, weight, out=into)
        else:
            torch.addmm(linear.bias, rows, weight, out=into)
    return out


def _heads(attn: Attention, qkv: Tensor, images: int) -> tuple[Tensor, Tensor, Tensor]:
    """(B*N, 3D) projected rows -> q, k, v, each (B, H, N, d), as timm's Attention views them."""
    qkv = qkv.view(images, -1, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    return attn.q_norm(q), attn.k_norm(k), v


def apart_block(block: Block, z: Tensor, images: int, num_base: int, rows: RowAttention) -> Tensor:
    """z (B*T + B*R, D), flat as above, through one block; ``rows`` is the class-token rows' attention."""
    attn, mlp = block.attn, block.mlp
    n = images * num_base
    h = block.norm1(z)
    qkv = products_apart(attn.qkv, h[:n], h[n:])  # (B*T + B*R, 3D)
    q_x, k_x, v_x = _heads(attn, qkv[:n], images)  # (B, H, T, d)
    q_c, k_c, v_c = _heads(attn, qkv[n:], images)  # (B, H, R, d)
    o_x = base_attention(attn, q_x, k_x, v_x).transpose(1, 2).reshape(n, -1)  # (B*T, D), as timm
    o_c = rows(attn, q_c, k_c, v_c, k_x, v_x).reshape(z.shape[0] - n, -1)  # (B*R, D)
    del qkv, q_x, k_x, v_x, q_c, k_c, v_c
    o = products_apart(attn.proj, attn.norm(o_x), attn.norm(o_c))
    z = z + block.drop_path1(block.ls1(attn.proj_drop(o)))
    h = block.norm2(z)
    f = mlp.norm(mlp.drop1(mlp.act(products_apart(mlp.fc1, h[:n], h[n:]))))
    return z + block.drop_path2(block.ls2(mlp.drop2(products_apart(mlp.fc2, f[:n], f[n:]))))
