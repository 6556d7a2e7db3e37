"""Every layer's memory keys and values in one batched product, for training.

``attention.project_memory`` projects one layer's memory at a time (norm1, qkv, then the split into
heads): about eight recorded autograd nodes per layer. A training step prepares its adapters on
every step, so on a 12-layer base that is a hundred nodes, recorded and run back, for a few rows of
memory each; from an activation cache, where a step is only the class tokens' path, that is a
measurable part of the step (docs/design.md §2.9, "Cost per operation"). ``StackedProjection`` does
all layers at once: one LayerNorm over (L, m, D) and one ``baddbmm`` against the layers' key and
value weights stacked (L, 2A, D). The stack is kept across steps for as long as the base's tensors
are the same ones, unchanged (their storage and version counters say so); serving never builds it.

It covers timm's blocks whose norm1 is a plain LayerNorm (one eps for all) and whose key projection
has no norm; for any other base ``project`` returns None and the caller projects layer by layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from timm.layers import LayerNorm
from torch import Tensor, nn


def plain_layer_norm(norm: nn.Module) -> bool:
    """torch's LayerNorm, or timm's without its fast-norm option (then it is torch's)."""
    return type(norm) is nn.LayerNorm or (type(norm) is LayerNorm and not norm._fast_norm)


class StackedProjection:
    """Memory (L, m, D) -> keys and values (L, H, m, d) through every block's norm1 and qkv at once."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._weights: tuple[Tensor, Tensor | None, Tensor, Tensor] | None = None

    def project(
        self, blocks: Sequence[nn.Module], memory: Tensor, memory_norm: str
    ) -> tuple[Tensor, Tensor, Tensor] | None:
        """The keys and values ``attention.project_memory`` gives layer by layer, to float rounding,
        and the rows (L, m, D) they are projected from (the normed memory, or the memory itself);
        None when a block is not one this covers."""
        stacked = self._stacked(blocks)
        if stacked is None:
            return None
        w_kv, b_kv, w_norm, b_norm = stacked  # (L, D, 2A), (L, 1, 2A), (L, 1, D), (L, 1, D)
        L, m, _ = memory.shape
        attn = blocks[0].attn
        h = memory
        if memory_norm == "norm1":
            norm = blocks[0].norm1
            h = torch.addcmul(b_norm, F.layer_norm(memory, norm.normalized_shape, eps=norm.eps), w_norm)
        kv = torch.bmm(h, w_kv) if b_kv is None else torch.baddbmm(b_kv, h, w_kv)  # (L, m, 2A)
        k, v = kv.view(L, m, 2, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        return k, v, h  # (L, H, m, d) each, (L, m, D)

    def _stacked(self, blocks: Sequence[nn.Module]) -> tuple[Tensor, Tensor | None, Tensor, Tensor] | None:
        tensors = _tensors(blocks)
        if tensors is None:
            return None
        key = tuple((t.data_ptr(), t._version, t.dtype, t.device) for t in tensors)
        if key != self._key:
            self._weights, self._key = _stack(blocks), key
        return self._weights


def _tensors(blocks: Sequence[nn.Module]) -> list[Tensor] | None:
    """Every tensor the stack is made from; None when a block is not covered."""
    tensors: list[Tensor] = []
    eps = {b.norm1.eps for b in blocks if hasattr(b, "norm1") and hasattr(b.norm1, "eps")}
    for block in blocks:
        attn, norm = getattr(block, "attn", None), getattr(block, "norm1", None)
        qkv = getattr(attn, "qkv", None)
        if type(qkv) is not nn.Linear or not isinstance(getattr(attn, "k_norm", None), nn.Identity):
            return None
        if not plain_layer_norm(norm) or norm.weight is None or norm.bias is None or len(eps) != 1:
            return None
        tensors += [qkv.weight, norm.weight, norm.bias] + ([] if qkv.bias is None else [qkv.bias])
    biases = {b.attn.qkv.bias is None for b in blocks}
    if len(biases) != 1 or any(t.requires_grad for t in tensors):  # a mix, or a base being trained
        return None
    return tensors


@torch.no_grad()
def _stack(blocks: Sequence[nn.Module]) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """The base is frozen: its stacked weights are constants of the training graph."""
    width = blocks[0].attn.attn_dim
    w_kv = torch.stack([b.attn.qkv.weight[width:].t() for b in blocks])  # (L, D, 2A)
    bias = blocks[0].attn.qkv.bias
    b_kv = None if bias is None else torch.stack([b.attn.qkv.bias[width:] for b in blocks]).unsqueeze(1)
    w_norm = torch.stack([b.norm1.weight for b in blocks]).unsqueeze(1)
    b_norm = torch.stack([b.norm1.bias for b in blocks]).unsqueeze(1)
    return w_kv, b_kv, w_norm, b_norm
