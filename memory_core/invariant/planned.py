"""The batch-invariant mode of a planned pass (memory_core/invariant/mode.py's rules, over slot pools).

The class-token rows' memory is gathered from the pools and run through ``invariant.features``; on
the Triton kernels (CUDA) the rows' attention is the kernel itself, one program per image, head and
row, whose every sum runs over its own inputs in a fixed order (docs/design.md §2.6, §2.10).
"""

from __future__ import annotations

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import Tensor

from ..routing import triton_kernels
from ..routing.plan import PlanShape, PlanTensors
from ..routing.planned import SlotAttention, layer_memory, lineage_of, rows_of
from ..routing.slots import SlotPools
from .blocks import InvariantBlocks, in_blocks, pad_up
from .mode import PlannedRows, features, head


def planned(
    base: VisionTransformer,
    x: Tensor,
    plan: PlanTensors,
    shape: PlanShape,
    pools: SlotPools,
    blocks: InvariantBlocks,
    *,
    kernels: str = "torch",
) -> tuple[Tensor, Tensor]:
    """``planned.planned_forward`` with every call's shape fixed: images (B, C, H, W) -> base logits
    and the plan's adapter logits, in the same layout."""
    depth = len(base.blocks)
    if kernels == "triton":
        # Rows per program fixed (InvariantBlocks.kernel_rows), never picked by the plan's row count.
        layers = tuple(SlotAttention(pools, i, plan, shape, blocks.kernel_rows) for i in range(depth))
    else:
        bias = rows_of(pools.memory_bias, plan, shape, expand=False)
        lineage = lineage_of(plan, shape, x.dtype)
        layers = tuple(layer_memory(pools, i, plan, shape, bias, lineage) for i in range(depth))
    x_tokens, c = features(base, x, PlannedRows(rows_of(pools.cls, plan, shape), layers), blocks)
    B, R, D = c.shape
    if shape.shared:  # outputs (R, B): row r of image b is class-token row b * R + r, slot r's head
        r = torch.arange(R, device=c.device).view(R, 1).expand(R, B).reshape(-1)
        b = torch.arange(B, device=c.device).view(1, B).expand(R, B).reshape(-1)
        out_rows, out_slots = b * R + r, plan.row_slots.index_select(0, r)
    else:
        out_rows, out_slots = plan.out_rows, plan.out_slots
    flat = c.reshape(B * R, D).contiguous()
    if kernels == "triton":  # one program per output row, its sums in a fixed order
        weight, bias = pools.head_weight, pools.head_bias
        return head(base, x_tokens, blocks), triton_kernels.gathered_heads(
            flat, out_rows, out_slots, weight, bias
        )
    # Heads in fixed chunks of columns: the pools pad every head to the most classes resident, which
    # grows as adapters come, and a product's kernel depends on its column count.
    chunks = -(-pools.classes // blocks.classes)

    def heads(rows: Tensor, slots: Tensor) -> Tensor:  # one (1, D) x (D, classes) product per chunk
        n = rows.shape[0]
        x = flat.index_select(0, rows)[:, None].expand(n, chunks, D).reshape(n * chunks, 1, D)
        w = pad_up(pools.head_weight.index_select(0, slots), 1, blocks.classes)  # (n, C', D)
        b = pad_up(pools.head_bias.index_select(0, slots), 1, blocks.classes)
        w, b = w.reshape(n * chunks, blocks.classes, D), b.reshape(n * chunks, 1, blocks.classes)
        return torch.baddbmm(b, x, w.transpose(1, 2)).reshape(n, -1)

    logits = in_blocks(heads, blocks.thin, out_rows, out_slots)
    return head(base, x_tokens, blocks), logits[:, : pools.classes]
