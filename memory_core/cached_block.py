"""One class-token block written out forward and backward, for training from an activation cache.

From a cache a training step is only the adapters' class-token rows, B*K of them through every block.
At that size PyTorch's cost per operation, not the arithmetic, sets the pace: recording about 60
autograd nodes per block and running them back costs as much as the maths they do (DeiT-Tiny, batch
32, one adapter: a recorded forward pass takes a third longer than the same pass unrecorded). So
``cached_class_token_block`` runs the common block as ONE autograd node: its forward pass is the
generic path's own operations, unrecorded, and its backward pass is written out below with aten's
LayerNorm and GELU backward kernels. It covers timm's pre-norm block (LayerNorm, GELU MLP, no layer
scale, no q/k norm, no dropout in effect), shared memory with each adapter its own lineage (what
training builds) and the "inputs" store; anything else takes the generic, recorded path
(``attention.class_token_block``). tests/memory_core/test_cached_block.py holds the two to float64
rounding and checks which path each base takes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from timm.layers import Mlp
from timm.models.vision_transformer import Block
from torch import Tensor, nn

from .attention import BaseKeys, LayerMemory, class_token_block, softmax_dtype
from .memory_projection import plain_layer_norm
from .stored_attention import Folded, NormedInputs, attend_inputs, attend_inputs_backward


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
        memory.lineage.ndim == 2  # shared, not routed
        and memory.lineage.shape[-1] == 1  # concatenation mode: each row's lineage is itself
        and plain_layer_norm(block.norm1)
        and plain_layer_norm(block.norm2)
        and all(isinstance(m, nn.Identity) for m in (*identities, mlp.norm))
        and getattr(attn, "gate", None) is None
        and type(mlp.act) is nn.GELU
        and not any(isinstance(m, nn.Dropout) and m.training and m.p > 0 for m in dropouts)
    )


def cached_class_token_block(block: nn.Module, c: Tensor, base: BaseKeys, memory: LayerMemory) -> Tensor:
    """Adapter class tokens c (B, K, D) through one block, reading a cached layer as ``base``."""
    if not written_out(block, base, memory):
        return class_token_block(block, c, base, memory)
    return _ClassTokenBlock.apply(c, memory.keys, memory.values, base.h, block, memory.bias)


def _layer_norm(norm: nn.LayerNorm, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return torch.native_layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


def _layer_norm_backward(norm: nn.LayerNorm, grad: Tensor, x: Tensor, mean: Tensor, rstd: Tensor) -> Tensor:
    shape, (w, b) = norm.normalized_shape, (norm.weight, norm.bias)
    return torch.ops.aten.native_layer_norm_backward(grad, x, shape, mean, rstd, w, b, (True, False, False))[
        0
    ]


# Each class token's memory, (K, H, P, d), against per-row tensors (B, H, K, ...): einsum's products
# as one bmm over the K*H (adapter, head) pairs each.
def _scores(x: Tensor, m: Tensor) -> Tensor:
    """x (B, H, K, d), m (K, H, P, d) -> (B, H, K, P): ``einsum("bhkd,khpd->bhkp")``."""
    B, H, K, d = x.shape
    out = torch.bmm(x.permute(2, 1, 0, 3).reshape(K * H, B, d), m.reshape(K * H, -1, d).transpose(1, 2))
    return out.view(K, H, B, -1).permute(2, 1, 0, 3)


def _mix(p: Tensor, m: Tensor) -> Tensor:
    """p (B, H, K, P), m (K, H, P, d) -> (B, H, K, d): ``einsum("bhkp,khpd->bhkd")``."""
    B, H, K, P = p.shape
    out = torch.bmm(p.permute(2, 1, 0, 3).reshape(K * H, B, P), m.reshape(K * H, P, -1))
    return out.view(K, H, B, -1).permute(2, 1, 0, 3)


def _outer(p: Tensor, x: Tensor) -> Tensor:
    """p (B, H, K, P), x (B, H, K, d) -> (K, H, P, d), over the batch: ``einsum("bhkp,bhkd->khpd")``."""
    B, H, K, P = p.shape
    out = torch.bmm(p.permute(2, 1, 3, 0).reshape(K * H, P, B), x.permute(2, 1, 0, 3).reshape(K * H, B, -1))
    return out.view(K, H, P, -1)


class _ClassTokenBlock(torch.autograd.Function):
    """c (B, K, D), memory keys and values (K, H, P, d), the stored normed inputs h (B, T, D) -> c.

    The forward pass, as ``attention.class_token_block`` and ``adapter_attention`` compute it:

        h_c = norm1(c);  q, k, v = qkv(h_c) per head;  q *= scale
        p   = softmax([base scores ; q.k (itself) ; q.memory keys + bias])
        o   = base part + p_self v + p_mem memory values
        c1  = c + proj(o);  c2 = c1 + fc2(gelu(fc1(norm2(c1))))

    The base is frozen: gradients flow to c and to the memory keys and values only.
    """

    @staticmethod
    def forward(
        ctx, c: Tensor, mem_k: Tensor, mem_v: Tensor, h: Tensor, block: Block, mem_bias: Tensor
    ) -> Tensor:
        attn, mlp = block.attn, block.mlp
        c = c.contiguous()  # the first block's c is the class tokens expanded over the batch
        B, K, D = c.shape
        h_c, mean1, rstd1 = _layer_norm(block.norm1, c)
        qkv = F.linear(h_c, attn.qkv.weight, attn.qkv.bias)
        q, k, v = qkv.reshape(B, K, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q = q * attn.scale  # (B, H, K, d), as k and v
        s_self = (q * k).sum(-1, keepdim=True)  # (B, H, K, 1)
        s_mem = _scores(q, mem_k) + mem_bias  # (B, H, K, P)
        folded, dtype = Folded.of(attn, q), softmax_dtype(q.dtype)
        o_x, p = attend_inputs(q, torch.cat([s_self, s_mem], dim=-1), h, folded, dtype)
        T = h.shape[1]
        o = o_x + p[..., T : T + 1] * v + _mix(p[..., T + 1 :], mem_v)
        c1 = c + F.linear(o.transpose(1, 2).reshape(B, K, D), attn.proj.weight, attn.proj.bias)
        h2, mean2, rstd2 = _layer_norm(block.norm2, c1)
        a = F.linear(h2, mlp.fc1.weight, mlp.fc1.bias)  # (B, K, hidden)
        c2 = c1 + F.linear(mlp.act(a), mlp.fc2.weight, mlp.fc2.bias)
        ctx.save_for_backward(c, mean1, rstd1, q, k, v, p, h, mem_k, mem_v, c1, mean2, rstd2, a)
        ctx.block, ctx.folded, ctx.dtype = block, folded, dtype
        return c2

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        c, mean1, rstd1, q, k, v, p, h, mem_k, mem_v, c1, mean2, rstd2, a = ctx.saved_tensors
        block, folded = ctx.block, ctx.folded
        attn, mlp = block.attn, block.mlp
        B, K, D = c.shape
        T = h.shape[1]
        # MLP and its residual
        grad_a = torch.ops.aten.gelu_backward(grad @ mlp.fc2.weight, a, approximate=mlp.act.approximate)
        grad_c1 = grad + _layer_norm_backward(block.norm2, grad_a @ mlp.fc1.weight, c1, mean2, rstd2)
        # attention output: its three parts
        grad_o = (grad_c1 @ attn.proj.weight).view(B, K, attn.num_heads, -1).transpose(1, 2)  # (B, H, K, d)
        p_self, p_mem = p[..., T : T + 1], p[..., T + 1 :]
        grad_v = p_self * grad_o
        grad_mem_v = _outer(p_mem, grad_o)
        grad_other = torch.cat([(grad_o * v).sum(-1, keepdim=True), _scores(grad_o, mem_v)], dim=-1)
        # one softmax over the base, itself and the memory; then the scores
        grad_q, grad_s = attend_inputs_backward(grad_o, grad_other, q, h, p, folded, ctx.dtype)
        grad_s_self, grad_s_mem = grad_s[..., :1], grad_s[..., 1:]
        grad_q = grad_q + grad_s_self * k + _mix(grad_s_mem, mem_k)
        grad_k = grad_s_self * q  # q is already scaled
        grad_mem_k = _outer(grad_s_mem, q)
        grad_qkv = (
            torch.stack([grad_q * attn.scale, grad_k, grad_v]).permute(1, 3, 0, 2, 4).reshape(B, K, 3 * D)
        )
        grad_c = grad_c1 + _layer_norm_backward(block.norm1, grad_qkv @ attn.qkv.weight, c, mean1, rstd1)
        return grad_c, grad_mem_k, grad_mem_v, None, None, None
