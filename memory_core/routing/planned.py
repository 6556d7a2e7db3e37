"""The inference pass over adapter slots: a planned batch's logits, with a fixed set of operations.

    base_logits, adapter_logits = planned_forward(base, tokens, plan, shape, pools)

Everything here is device work on tensors: the base tokens, the plan's integer tensors and the slot
pools. Nothing depends on a tensor's values on the host (no ``.item()``, ``nonzero`` or boolean
indexing), and the operations are the same whatever adapters are resident or asked for: only the
plan's shape (B, R, A, layout) selects them. So one trace or one captured CUDA graph serves every
batch of that shape (memory_core/routing/graphs.py), and a pass costs its base pass plus its rows' work.

Per block the class-token rows ride in the base's own linear layers ([X ; C], docs/design.md §2.1);
only their attention differs, computed by one of two implementations of the same operation:
- ``kernels="triton"``: one Triton kernel per block (memory_core/routing/triton_kernels.py), writing the rows'
  output beside the base rows' output, so the block adds one launch to timm's;
- ``kernels="torch"``: the slot rows' memory gathered from the pools, then the attention of
  memory_core/block/attention.py (the CPU path, and the reference the kernel is tested against).
Heads: a shared plan applies each row's head to all images as one batched product; a routed plan
applies each output's head found by its slot (one gathered product, or the Triton gathered heads).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from timm.layers import Attention
from timm.models.vision_transformer import Block, VisionTransformer
from torch import Tensor

from ..block.apart import apart_block, apart_supported
from ..block.attention import LayerMemory, _finish, base_attention, project_qkv, split_block
from ..block.merged import class_rows_attention, merged_block, merged_last_block, trimmable
from . import triton_kernels
from .plan import PlanShape, PlanTensors
from .slots import SlotPools


def planned_forward(
    base: VisionTransformer,
    x: Tensor,
    plan: PlanTensors,
    shape: PlanShape,
    pools: SlotPools,
    *,
    kernels: str = "torch",
    path: str = "merged",
    gemms: str = "joined",
    trim: bool = False,
    head_run: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Embedded base tokens (B, T, D) -> base logits (B, C_0) and adapter logits: (N, C) for a routed
    plan, (R * B, C) row-major over (row, image) for a shared one; C is the pools' padded class count.

    ``path``: "merged" (inference: base and class-token rows share each block's per-token modules) or
    "split" (torch kernels only: the rows apart, as training computes them). ``gemms``, for "merged":
    "joined" (one product per linear layer over every row) or "apart" (the base rows' products on the
    base pass's own shape, block/apart.py; where a block is not timm's plain one, "joined"). ``trim``,
    for "merged", "joined" and the torch kernels: the last block computes only the base rows the base
    head reads and the class-token rows (``merged_last_block``), where the head reads a prefix.
    ``head_run``: a shared plan's first slot when its rows' slots are consecutive (``PassPlan.head_run``,
    read on the host): the torch heads then read the pool in place. Only for a pass that is not
    captured: a graph would bake the value in."""
    if gemms not in ("joined", "apart"):
        raise ValueError(f"gemms must be 'joined' or 'apart', got {gemms!r}")
    B, T, D = x.shape
    c = base.norm_pre(rows_of(pools.cls, plan, shape))  # (B, R, D)
    if kernels == "torch":  # what the torch attention reads; the Triton kernel reads the plan itself
        lineage = lineage_of(plan, shape, x.dtype)
        bias = rows_of(pools.memory_bias, plan, shape, expand=False)  # (R, P) shared, (B, R, P) routed
    if path == "split":
        if kernels != "torch":
            raise ValueError("the split path runs on the torch kernels")
        for i, block in enumerate(base.blocks):
            x, c = split_block(block, x, c, layer_memory(pools, i, plan, shape, bias, lineage))
        x, c = base.norm(x), base.norm(c)
    elif path == "merged" and gemms == "apart" and all(apart_supported(b) for b in base.blocks):
        n = B * T
        z = torch.cat([x.reshape(n, D), c.reshape(-1, D)])  # (B*T + B*R, D): base rows, then the rest
        for i, block in enumerate(base.blocks):
            if kernels == "triton":
                rows = SlotAttention(pools, i, plan, shape).apart
            else:
                memory = layer_memory(pools, i, plan, shape, bias, lineage)
                rows = partial(class_rows_attention, memory=memory)
            z = apart_block(block, z, B, T, rows)
        z = base.norm(z)
        x, c = z[:n].view(B, T, D), z[n:].view(B, -1, D)
    elif path == "merged":
        z = torch.cat([x, c], dim=1)  # (B, T+R, D)
        last = len(base.blocks) - 1
        for i, block in enumerate(base.blocks):
            if kernels == "triton":
                z = triton_block(block, z, T, SlotAttention(pools, i, plan, shape))
                continue
            memory = layer_memory(pools, i, plan, shape, bias, lineage)
            if i == last and trim and read_by_head(base) is not None and trimmable(block):
                z = merged_last_block(block, z, T, memory, read_by_head(base))  # (B, read + R, D)
                T = read_by_head(base)
            else:
                z = merged_block(block, z, T, memory)
        z = base.norm(z)  # one norm over every row: a norm of each slice would copy it first
        x, c = z[:, :T], z[:, T:]
    else:
        raise ValueError(f"path must be 'merged' or 'split', got {path!r}")
    return base.forward_head(x), heads(c, pools, plan, shape, kernels=kernels, run=head_run)


def read_by_head(base: VisionTransformer) -> int | None:
    """How many leading base rows the base head may read after the last block: with timm's token
    pooling (the only pooling the engine serves, weights/spec.py) the prefix tokens (the class token,
    a distilled DeiT's distillation token, registers, which nobody reads but are few); None where it
    would read every row (average or attention pooling)."""
    if getattr(base, "attn_pool", None) is None and getattr(base, "global_pool", None) == "token":
        return base.num_prefix_tokens
    return None


def rows_of(pool: Tensor, plan: PlanTensors, shape: PlanShape, *, expand: bool = True) -> Tensor:
    """Each class-token row's entry of a per-slot ``pool`` (S, ...): (B, R, ...), or (R, ...) for a
    shared plan when not ``expand``ed."""
    picked = pool.index_select(0, plan.row_slots.reshape(-1))
    picked = picked.view(*plan.row_slots.shape, *pool.shape[1:])
    if shape.shared and expand:
        return picked.expand(shape.images, *picked.shape)
    return picked


def lineage_of(plan: PlanTensors, shape: PlanShape, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Each row's lineage as row positions (itself first) and its bias (0, -inf on padding): (R, A)
    when shared, else (B, R, A). In concatenation mode (A = 1) every row is its own lineage."""
    R = shape.rows
    if shape.lineage == 1:
        own = torch.arange(R, device=plan.row_slots.device).view(R, 1)
        lineage = own if shape.shared else own.expand(shape.images, R, 1)
        return lineage, torch.zeros(lineage.shape, device=own.device, dtype=dtype)
    lineage = plan.lineage
    bias = torch.zeros(lineage.shape, device=lineage.device, dtype=dtype).masked_fill_(
        lineage < 0, float("-inf")
    )
    return lineage.clamp(min=0), bias


def layer_memory(
    pools: SlotPools, layer: int, plan: PlanTensors, shape: PlanShape, bias: Tensor, lineage: tuple
) -> LayerMemory:
    """One layer's memory for the torch attention: each row's slot's keys and values, gathered."""
    return LayerMemory(
        keys=rows_of(pools.keys[layer], plan, shape, expand=False),  # (R, H, P, d) or (B, R, H, P, d)
        values=rows_of(pools.values[layer], plan, shape, expand=False),
        bias=bias,
        lineage=lineage[0],
        lineage_bias=lineage[1],
    )


@dataclass(frozen=True)
class SlotAttention:
    """One layer's class-token attention by the Triton kernel, reading the slot pools in place."""

    pools: SlotPools
    layer: int
    plan: PlanTensors
    shape: PlanShape
    block_rows: int | None = None  # rows per kernel program; None: by R (fixed in the invariant mode)

    def into(self, o: Tensor, attn: Attention, q: Tensor, k: Tensor, v: Tensor, num_base: int) -> None:
        """Write the rows' attention into ``o[:, T:]`` (B, T+R, H, d); q, k, v (B, H, T+R, d)."""
        T = num_base
        self.rows(o[:, T:], attn, q[:, :, T:], k[:, :, T:], v[:, :, T:], k[:, :, :T], v[:, :, :T])

    def apart(self, attn: Attention, q: Tensor, k: Tensor, v: Tensor, k_x: Tensor, v_x: Tensor) -> Tensor:
        """The rows' attention, their q, k, v (B, H, R, d) apart from the base's: (B, R, H, d)."""
        B, H, R, d = q.shape
        o = q.new_empty(B, R, H, d)
        self.rows(o, attn, q, k, v, k_x, v_x)
        return o

    def rows(
        self, o: Tensor, attn: Attention, q: Tensor, k: Tensor, v: Tensor, k_x: Tensor, v_x: Tensor
    ) -> None:
        """Write the rows' attention into ``o`` (B, R, H, d): their q, k, v (B, H, R, d), the base
        keys and values k_x, v_x (B, H, T, d)."""
        B = q.shape[0]
        plan, shape = self.plan, self.shape
        row_slots = plan.row_slots.expand(B, -1) if shape.shared else plan.row_slots  # stride 0 if shared
        lineage = None
        if shape.lineage > 1:
            lineage = plan.lineage.expand(B, -1, -1) if shape.shared else plan.lineage
        pools = self.pools
        keys, values = pools.keys[self.layer], pools.values[self.layer]
        triton_kernels.class_token_attention_kernel(
            o, q, k, v, k_x, v_x, keys, values, pools.memory_length, row_slots, lineage, attn.scale,
            block_rows=self.block_rows,
        )  # fmt: skip


def triton_block(block: Block, z: Tensor, num_base: int, attention: SlotAttention) -> Tensor:
    """``merged_block`` with the class-token rows' attention as one Triton kernel."""
    T = num_base
    attn = block.attn
    h = block.norm1(z)
    q, k, v = project_qkv(attn, h)  # (B, H, T+R, d) each, views of one projection
    B, H, N, d = q.shape
    # Every row's queries over the base keys, in the base's own attention kernel: the base rows get
    # exactly what it gives them alone (a query row's result does not depend on the other rows), and
    # the output comes in the block's (B, N, H, d) layout (flash and cuDNN write it so), where the
    # kernel then overwrites the class-token rows. Writing the base rows into a buffer instead was a
    # strided copy of every base row per block (0.34 ms of ViT-B/16's 6 ms at batch 64 on an H200).
    o = base_attention(attn, q, k[:, :, :T], v[:, :, :T]).transpose(1, 2)  # (B, N, H, d)
    if not o.is_contiguous():  # a backend that writes (B, H, N, d): one copy, as timm's reshape
        o = o.contiguous()
    attention.into(o, attn, q, k, v, T)
    return _finish(block, z, h, o.view(B, N, H * d))


def heads(
    c: Tensor, pools: SlotPools, plan: PlanTensors, shape: PlanShape, *, kernels: str, run: int | None = None
) -> Tensor:
    """Final class tokens (B, R, D) -> adapter logits, (R * B, C) shared or (N, C) routed; ``run``:
    the shared rows' first slot when their slots are consecutive (``planned_forward``)."""
    B, R, D = c.shape
    if shape.shared:  # every image asks for every row's task: batched products over the rows
        if kernels == "triton":  # every head read in place, one launch
            logits = triton_kernels.shared_heads(c, plan.row_slots, pools.head_weight, pools.head_bias)
            return logits.view(R * B, -1)
        return shared_heads(c, pools, plan.row_slots, run=run).reshape(R * B, -1)
    flat = c.reshape(B * R, D)
    if kernels == "triton":
        return triton_kernels.gathered_heads(
            flat, plan.out_rows, plan.out_slots, pools.head_weight, pools.head_bias
        )
    return gathered_heads(flat, plan.out_rows, plan.out_slots, pools.head_weight, pools.head_bias)


# The most bytes of head weights one shared product gathers: 1,000 adapters of 1,000 classes on a
# ViT-B would otherwise copy 3 GB of weights per all-tasks pass (float32); in chunks of rows, the
# copy stays this small whatever K is (the number of chunks depends on the plan's shape alone).
SHARED_HEAD_BYTES = 64 << 20


def shared_heads(c: Tensor, pools: SlotPools, row_slots: Tensor, *, run: int | None = None) -> Tensor:
    """Final class tokens (B, R, D), every row's head applied to every image -> (R, B, C): one
    batched product per chunk of rows, each gathering only its chunk's heads from the pool; or,
    when the rows' slots are ``run``, ``run`` + 1, ... (known on the host), one product over a view
    of the pool. The gather is a copy of every head per pass: for ViT-B/32's 8 heads of 1,000
    classes, 25 MB, 2-12 ms of a 1.9 s pass on one CPU thread, more than the heads' product (4.4 ms).
    Each image's logits are the same bits either way (the same product per row, on the same strides)."""
    _, R, D = c.shape  # (B, R, D)
    if run is not None:
        weight = pools.head_weight.narrow(0, run, R)  # (R, C, D), in place
        bias = pools.head_bias.narrow(0, run, R).unsqueeze(1)  # (R, 1, C)
        return torch.baddbmm(bias, c.transpose(0, 1), weight.transpose(1, 2))  # (R, B, C)
    C = pools.head_weight.shape[1]
    per_chunk = max(1, SHARED_HEAD_BYTES // max(1, C * D * pools.head_weight.element_size()))
    parts = []
    for start in range(0, R, per_chunk):
        slots = row_slots[start : start + per_chunk]
        weight = pools.head_weight.index_select(0, slots)  # (r, C, D)
        bias = pools.head_bias.index_select(0, slots).unsqueeze(1)  # (r, 1, C)
        rows = c[:, start : start + per_chunk].transpose(0, 1)  # (r, B, D)
        parts.append(torch.baddbmm(bias, rows, weight.transpose(1, 2)))  # (r, B, C)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def gathered_heads(c: Tensor, out_rows: Tensor, out_slots: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """The torch gathered heads: output n = row ``out_rows[n]`` of c (M, D) through head
    ``out_slots[n]`` of the pool (S, C, D), (S, C), one matrix per output. Returns (N, C)."""
    rows = c.index_select(0, out_rows).unsqueeze(1)  # (N, 1, D)
    w = weight.index_select(0, out_slots)  # (N, C, D)
    b = bias.index_select(0, out_slots).unsqueeze(1)  # (N, 1, C)
    return torch.baddbmm(b, rows, w.transpose(1, 2)).squeeze(1)
