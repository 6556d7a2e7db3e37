"""One class-token block written out forward and backward, for training from an activation cache.

From a cache a training step is only the adapters' class-token rows, B*K of them through every block.
At that size PyTorch's cost per operation, not the arithmetic, sets the pace: recording about 60
autograd nodes per block and running them back costs as much as the maths they do (DeiT-Tiny, batch
32, one adapter: a recorded forward pass takes a third longer than the same pass unrecorded). So
``stored_class_token_block`` runs the common block as ONE autograd node, its backward pass written
out below with aten's LayerNorm and GELU backward kernels, and computes it in fewer, larger
operations than the generic path: the frozen attention folded into two linear layers
(memory_core/stored/folded_attention.py), the token itself and its memory read as more rows beside the
stored base rows, not through their own keys and values (a cached DeiT-Tiny epoch 14% faster;
docs/design.md §2.9).

It covers timm's pre-norm block (LayerNorm, GELU MLP, no layer scale, no q/k norm, no dropout in
effect), shared memory with each adapter its own lineage and its memory's rows at hand (what
training builds) and the "inputs" store; anything else takes the generic, recorded path
(``attention.class_token_block``). tests/memory_core/stored/test_cached_block.py holds the two to float64
rounding and checks which path each base takes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from timm.layers import Mlp
from timm.models.vision_transformer import Block
from torch import Tensor, nn

from ..block.attention import BaseKeys, LayerMemory, class_token_block, softmax_dtype
from .folded_attention import FoldedAttention, folded
from .memory_projection import plain_layer_norm
from .stored_attention import NormedInputs


def written_out(block: nn.Module, base: BaseKeys, memory: LayerMemory) -> bool:
    """Whether ``_ClassTokenBlock`` computes exactly what the generic path would for this block."""
    attn, mlp = getattr(block, "attn", None), getattr(block, "mlp", None)
    if not isinstance(block, Block) or type(mlp) is not Mlp or not isinstance(base, NormedInputs):
        return False
    identities = (
        attn.q_norm,
        attn.k_norm,
        attn.norm,
        block.ls1,
        block.ls2,
        block.drop_path1,
        block.drop_path2,
    )
    dropouts = (attn.proj_drop, mlp.drop1, mlp.drop2)
    return (
        memory.inputs is not None  # the memory's rows: training's stacked projection keeps them
        and memory.lineage.ndim == 2  # shared, not routed
        and memory.lineage.shape[-1] == 1  # concatenation mode: each row's lineage is itself
        and plain_layer_norm(block.norm1)
        and plain_layer_norm(block.norm2)
        and all(isinstance(m, nn.Identity) for m in (*identities, mlp.norm))
        and getattr(attn, "gate", None) is None
        and type(mlp.act) is nn.GELU
        and not any(isinstance(m, nn.Dropout) and m.training and m.p > 0 for m in dropouts)
    )


def stored_class_token_block(block: nn.Module, c: Tensor, base: BaseKeys, memory: LayerMemory) -> Tensor:
    """Adapter class tokens c (B, K, D) through one block, reading a cached layer as ``base``."""
    if not written_out(block, base, memory):
        return class_token_block(block, c, base, memory)
    bias = F.pad(memory.bias, (1, 0))  # (K, 1 + P): the token itself first, never masked
    return _ClassTokenBlock.apply(c, memory.inputs, base.h, block, bias, folded(block.attn))


def _layer_norm(norm: nn.LayerNorm, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return torch.native_layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


def _layer_norm_backward(norm: nn.LayerNorm, grad: Tensor, x: Tensor, mean: Tensor, rstd: Tensor) -> Tensor:
    shape, (w, b) = norm.normalized_shape, (norm.weight, norm.bias)
    return torch.ops.aten.native_layer_norm_backward(grad, x, shape, mean, rstd, w, b, (True, False, False))[
        0
    ]


def _per_token(x: Tensor, rows: Tensor) -> Tensor:
    """x (B*K, H, a), each class token's H query rows, times its own rows (B*K, R, a) -> (B*K, H, R)."""
    return torch.bmm(x, rows.transpose(1, 2))


class _ClassTokenBlock(torch.autograd.Function):
    """c (B, K, D), each adapter's memory as normed inputs (K, P, D), the stored normed inputs
    h (B, T, D) -> c, the attention folded (memory_core/stored/folded_attention.py).

    Every key and value a class token reads is affine in a normed input, so its attention runs over
    rows: the T base rows h, its own row h_c = norm1(c) and its memory rows (``E``, (B, K, 1 + P, D)):

        h_c = norm1(c);  u = query_key(h_c)       the H query rows of each token, (B, K, H, D)
        p   = softmax([u.h ; u.E + bias])         one softmax over the base, itself and its memory
        c1  = c + value_out(p_h h + p_E E)        the H weighted sums of rows -> the output
        c2  = c1 + fc2(gelu(fc1(norm2(c1))))

    The base is frozen: gradients flow to c and to the memory rows only.
    """

    @staticmethod
    def forward(
        ctx, c: Tensor, memory: Tensor, h: Tensor, block: Block, bias: Tensor, f: FoldedAttention
    ) -> Tensor:
        mlp = block.mlp
        c = c.contiguous()  # the first block's c is the class tokens expanded over the batch
        B, K, D = c.shape
        H, T = block.attn.num_heads, h.shape[1]
        h_c, mean1, rstd1 = _layer_norm(block.norm1, c)
        u = F.linear(h_c, f.query_key, f.query_key_bias)  # (B, K, H*D)
        rows = torch.cat([h_c.unsqueeze(2), memory.expand(B, -1, -1, -1)], dim=2)  # (B, K, R, D)
        R = rows.shape[2]
        wide = h.to(u.dtype)  # float16/bfloat16 storage is widened where it is read
        s_base = torch.bmm(u.view(B, K * H, D), wide.transpose(1, 2))  # (B, K*H, T)
        s_rows = _per_token(u.view(B * K, H, D), rows.view(B * K, R, D)).view(B, K, H, R) + bias[:, None]
        p = torch.cat([s_base, s_rows.view(B, K * H, R)], dim=-1)
        p = p.softmax(dim=-1, dtype=softmax_dtype(u.dtype)).to(u.dtype)  # (B, K*H, T + R)
        ph = torch.bmm(p[..., :T], wide).view(B * K, H, D)
        ph = ph.baddbmm_(p[..., T:].view(B * K, H, R), rows.view(B * K, R, D))
        c1 = c + F.linear(ph.view(B, K, H * D), f.value_out, f.value_out_bias)
        h2, mean2, rstd2 = _layer_norm(block.norm2, c1)
        a = F.linear(h2, mlp.fc1.weight, mlp.fc1.bias)  # (B, K, hidden)
        c2 = c1 + F.linear(mlp.act(a), mlp.fc2.weight, mlp.fc2.bias)
        ctx.save_for_backward(c, mean1, rstd1, u, p, h, rows, c1, mean2, rstd2, a)
        ctx.block, ctx.folded = block, f
        return c2

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        c, mean1, rstd1, u, p, h, rows, c1, mean2, rstd2, a = ctx.saved_tensors
        block, f = ctx.block, ctx.folded
        mlp = block.mlp
        B, K, D = c.shape
        H, T, R = block.attn.num_heads, h.shape[1], rows.shape[2]
        # MLP and its residual
        grad_a = torch.ops.aten.gelu_backward(grad @ mlp.fc2.weight, a, approximate=mlp.act.approximate)
        grad_c1 = grad + _layer_norm_backward(block.norm2, grad_a @ mlp.fc1.weight, c1, mean2, rstd2)
        # the weighted sums of rows, then the weights of each row
        grad_ph = grad_c1 @ f.value_out  # (B, K, H*D)
        wide = h.to(u.dtype)
        flat_rows = rows.view(B * K, R, D)
        grad_p = torch.cat(
            [
                torch.bmm(grad_ph.view(B, K * H, D), wide.transpose(1, 2)),
                _per_token(grad_ph.view(B * K, H, D), flat_rows).view(B, K * H, R),
            ],
            dim=-1,
        )
        # through the softmax, in its dtype
        pw, gw = p.to(softmax_dtype(u.dtype)), grad_p.to(softmax_dtype(u.dtype))
        grad_s = (pw * (gw - (gw * pw).sum(-1, keepdim=True))).to(u.dtype)  # (B, K*H, T + R)
        # the query rows, and each token's own rows (itself and its memory), read as scores and as sums
        grad_s_rows, p_rows = grad_s[..., T:].view(B * K, H, R), p[..., T:].view(B * K, H, R)
        grad_u = torch.bmm(grad_s[..., :T], wide).view(B * K, H, D).baddbmm_(grad_s_rows, flat_rows)
        weights = torch.cat([grad_s_rows, p_rows], dim=1).transpose(1, 2)  # (B*K, R, 2H)
        grad_rows = torch.bmm(weights, torch.cat([u.view(B * K, H, D), grad_ph.view(B * K, H, D)], dim=1))
        grad_rows = grad_rows.view(B, K, R, D)
        grad_h_c = grad_rows[:, :, 0] + grad_u.view(B, K, H * D) @ f.query_key
        grad_c = grad_c1 + _layer_norm_backward(block.norm1, grad_h_c, c, mean1, rstd1)
        return grad_c, grad_rows[:, :, 1:].sum(0), None, None, None, None
