"""Batch-invariant passes: an image's logits are bit-identical whatever else shares its pass.

This file holds the passes over a stack (``features``, ``invariant_block``, the heads); the call
sizes are invariant/blocks.py's, the class-token attention invariant/attention.py's.

The default pass is exact to float rounding, but its rounding depends on the batch: a matrix
product's kernel, and with it the order of its sums, is picked from the product's shape, and some
shapes grow with the number of images, of adapters resident and of rows a route builds. On this
project's CPUs the heads (B rows), the class-token attention (K rows per image; memory products of
B rows and P keys) and the memory projection at preparation (the rows of every adapter prepared
together) change their rounding so (docs/design.md §2.6 lists what was measured).

In this mode every reduction runs in calls whose shapes depend on neither the batch nor the set:

- heads, memory projections and the class-token queries run on fixed blocks of rows, the last block
  padded with zeros, so a row meets the same kernel whatever its neighbours;
- each class-token query is scored against its own keys (lineage, memory) in fixed chunks of keys:
  padding keys get zero weight and a chunk of padding adds exactly nothing, so an adapter's result
  does not depend on the longest memory of the adapters stacked with it;
- the softmax is assembled from those pieces: an exact max, exponentials, and sums taken by the
  same products as the weighted values (a column of ones), added in a fixed order;
- operands are made contiguous first, so no memory layout depends on the batch either;
- the token-row layers, the patch embedding and the base attention run in fixed blocks of rows and
  of images where the device needs it (``InvariantBlocks.for_device``: on CUDA; on CPU with MKL
  their kernels were measured not to depend on the batch, and blocking them would only cost).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import Block, VisionTransformer
from torch import Tensor, nn

from ..block.attention import LayerMemory, _finish, base_attention
from ..block.attention import project_memory as _project_memory
from ..routing.planned import SlotAttention
from ..sets.stack import AdapterStack
from .attention import invariant_class_token_attention
from .blocks import InvariantBlocks, in_blocks


@dataclass(frozen=True)
class PlannedRows:
    """A plan's class-token rows with their memory gathered from the slot pools, per image."""

    cls: Tensor  # (B, R, D)
    # Per block: the rows' memory (keys (R, H, P, d) shared or (B, R, H, P, d) routed), or the kernel.
    layers: tuple[LayerMemory | SlotAttention, ...]


def project_memory(
    block: Block, memory: Tensor, memory_norm: str, blocks: InvariantBlocks | None
) -> tuple[Tensor, Tensor]:
    """``attention.project_memory`` on fixed blocks of memory rows: (m, D) -> keys, values (H, m, d).

    ``prepare_many`` projects the memories of many adapters together; in fixed blocks, an adapter's
    keys do not depend on which others were prepared with it. ``blocks`` None: one product."""
    if blocks is None:
        return _project_memory(block, memory, memory_norm)

    def project(rows: Tensor) -> tuple[Tensor, Tensor]:
        k, v = _project_memory(block, rows, memory_norm)  # (H, n, d)
        return k.transpose(0, 1), v.transpose(0, 1)

    k, v = in_blocks(project, blocks.thin, memory)  # (m, H, d)
    return k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()


def features(
    base: VisionTransformer, x: Tensor, stack: AdapterStack | PlannedRows | None, blocks: InvariantBlocks
) -> tuple[Tensor, Tensor | None]:
    """``MemoryViT.forward_features`` (merged path): images -> final-normed base and class tokens."""
    x = in_blocks(base.patch_embed, blocks.images, x)
    x = base.patch_drop(base._pos_embed(x))  # additions and concatenation: exact per image
    B, T, _ = x.shape
    if stack is None:
        z, layers = x, [None] * len(base.blocks)
    else:
        cls = stack.cls if stack.cls.ndim == 3 else stack.cls.expand(B, -1, -1)
        z, layers = torch.cat([x, cls], dim=1), stack.layers
    z = _rows(base.norm_pre, z, blocks)
    for block, memory in zip(base.blocks, layers, strict=True):
        z = invariant_block(block, z, T, memory, blocks)
    z = _rows(base.norm, z, blocks)
    return z[:, :T], (None if stack is None else z[:, T:])


def _rows(fn: Callable[[Tensor], Tensor], z: Tensor, blocks: InvariantBlocks) -> Tensor:
    if isinstance(fn, nn.Identity):
        return z
    B, N, D = z.shape
    return in_blocks(fn, blocks.rows, z.reshape(B * N, D)).reshape(B, N, -1)


def invariant_block(
    block: Block, z: Tensor, T: int, memory: LayerMemory | SlotAttention | None, blocks: InvariantBlocks
) -> Tensor:
    """``merged_block`` (block/attention.py) with every call's shape fixed. z: [X ; C] (B, T+K, D)."""
    attn = block.attn
    B, N, D = z.shape
    gated = getattr(attn, "gate", None) is not None  # the one use of norm1's output after qkv

    def qkv_rows(r: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        h = block.norm1(r)
        return (attn.qkv(h), h) if gated else attn.qkv(h)

    out = in_blocks(qkv_rows, blocks.rows, z.reshape(B * N, D))
    qkv, h = out if gated else (out, None)
    q, k, v = qkv.reshape(B, N, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    q, k = attn.q_norm(q), attn.k_norm(k)  # (B, H, N, d); per-head norms work row by row
    k_x, v_x = k[:, :, :T], v[:, :, :T]
    o_x = in_blocks(lambda *t: base_attention(attn, *t), blocks.images, q[:, :, :T], k_x, v_x)  # (B, H, T, d)
    # Every row's output in the block's (B, N, H, d) layout, written once (a copy moves no bits).
    o = z.new_empty(B, N, attn.num_heads, attn.head_dim)
    o[:, :T] = o_x.transpose(1, 2)
    del o_x
    if N > T and isinstance(memory, SlotAttention):  # the Triton kernel: a row's result is its own
        memory.into(o, attn, q, k, v, T)
    elif N > T:
        o_c = invariant_class_token_attention(
            attn, q[:, :, T:], k[:, :, T:], v[:, :, T:], k_x, v_x, memory, blocks
        )
        o[:, T:] = o_c.transpose(1, 2)
    o = o.view(B * N, D)

    def finish(rows: Tensor, o_rows: Tensor, h_rows: Tensor | None = None) -> Tensor:
        return _finish(block, rows, h_rows, o_rows)

    parts = (z.reshape(B * N, D), o) if h is None else (z.reshape(B * N, D), o, h)
    return in_blocks(finish, blocks.rows, *parts).reshape(B, N, D)


def head(base: VisionTransformer, x: Tensor, blocks: InvariantBlocks) -> Tensor:
    """The base's own head (pooling, norm, classifier) on fixed blocks of images."""
    return in_blocks(base.forward_head, blocks.thin, x)


def adapter_heads(stack: AdapterStack, c: Tensor, blocks: InvariantBlocks) -> list[Tensor]:
    """``AdapterStack.apply_heads`` on fixed blocks of images, with contiguous rows."""
    return list(in_blocks(lambda rows: tuple(_heads(stack, rows, blocks)), blocks.thin, c))


def _heads(stack: AdapterStack, c: Tensor, blocks: InvariantBlocks) -> list[Tensor]:
    if not stack.head_groups:
        return [F.linear(c[:, k].contiguous(), w, b) for k, (w, b) in enumerate(stack.heads)]
    logits: list[Tensor] = [c] * len(stack.heads)  # every slot is overwritten below
    per_call = None if blocks.batches is None else blocks.thin  # heads per batched product
    for group in stack.head_groups:
        rows = c.index_select(1, group.members).transpose(0, 1).contiguous()  # (G, n, D)
        z = in_blocks(_grouped_head, per_call, rows, group.weight, group.bias)  # (G, n, C)
        for i, k in enumerate(group.members.tolist()):
            logits[k] = z[i]
    return logits


def _grouped_head(rows: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    return torch.baddbmm(bias[:, None], rows, weight.transpose(1, 2))
