"""Batch-invariant passes: an image's logits are bit-identical whatever else shares its pass.

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
from timm.layers import Attention
from timm.models.vision_transformer import Block, VisionTransformer
from torch import Tensor, nn

from ..block.attention import LayerMemory, _finish, base_attention
from ..block.attention import project_memory as _project_memory
from ..routing.planned import SlotAttention
from ..sets.stack import AdapterStack


@dataclass(frozen=True)
class PlannedRows:
    """A plan's class-token rows with their memory gathered from the slot pools, per image."""

    cls: Tensor  # (B, R, D)
    # Per block: the rows' memory (keys (R, H, P, d) shared or (B, R, H, P, d) routed), or the kernel.
    layers: tuple[LayerMemory | SlotAttention, ...]


@dataclass(frozen=True)
class InvariantBlocks:
    """The fixed call sizes of a batch-invariant pass. Any values give invariance; they trade speed."""

    rows: int | None = 256  # token rows per call of a per-token layer; None: all in one call
    thin: int = 8  # class-token queries per image per product, and rows per head call
    keys: int = 8  # own keys (lineage, memory) per chunk of the class-token attention
    classes: int = 16  # head columns per product: the padded class count of the slot pools may grow
    images: int | None = None  # images per patch-embedding and attention call; None: the whole batch
    # Class-token rows per call of their own-key products, and (in chunks of ``thin``) heads per call
    # of a head group's batched product. None: any count (on CPU a batched product's per-matrix
    # result was measured not to depend on the number of matrices).
    batches: int | None = None

    @classmethod
    def for_device(cls, device: torch.device, dtype: torch.dtype | None = None) -> InvariantBlocks:
        if device.type == "cuda" and dtype == torch.float32:
            # float32 (TF32 convolutions, cuBLAS's float32 kernels) did not hold with the per-token
            # layers and the patch embedding left whole (H200, DeiT-Tiny and ViT-B/16); these held
            # at 0.74-0.81 of the default mode's speed (benchmarks/RESULTS.md §1.6).
            return cls(rows=8192, thin=64, keys=8, images=32, batches=4096)
        if device.type == "cuda":
            # What changes with the batch on an H200 (the GPU suite's op probe): the thin products
            # (class-token scores, memory einsums over images, heads on few rows), which stay
            # blocked. The per-token layers and the base attention were invariant by themselves,
            # and left whole they held (base and routed adapters, image 0 alone against batches of
            # 2, 7 and 64, bf16) at 0.985 (DeiT-Tiny) and 0.996 (ViT-B/16) of the default mode's
            # speed, against 0.50-0.72 with them blocked by 4,096 rows (benchmarks/RESULTS.md §1.6).
            return cls(rows=None, thin=64, keys=8, images=None, batches=4096)
        # MKL's product kernel depends on the row count only below 4 rows (measured: 1, 2-3 and 4+
        # rows take three kernels, at any thread count), and a pass has more token rows than that:
        # blocking them would only cost. Other CPU BLAS libraries get blocks.
        return cls(rows=None if torch.backends.mkl.is_available() else 256)


def in_blocks(fn: Callable[..., Tensor | tuple[Tensor, ...]], size: int | None, *xs: Tensor):
    """``fn`` over blocks of ``size`` rows (dim 0) of ``xs``, the last one zero-padded; None: one call."""
    n = xs[0].shape[0]
    if size is None:
        return fn(*xs)
    outs = []
    for start in range(0, n, size):
        parts = [x[start : start + size] for x in xs]
        if parts[0].shape[0] < size:
            parts = [torch.cat([p, p.new_zeros(size - p.shape[0], *p.shape[1:])]) for p in parts]
        outs.append(fn(*parts))
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(o)[:n] for o in zip(*outs, strict=True))
    return torch.cat(outs)[:n]


def _bmm(a: Tensor, b: Tensor) -> Tensor:
    """(..., m, k) @ (..., k, n) as one bmm, each matrix's rows contiguous: the layout BLAS sees, and
    with it the kernel, never depends on how many matrices there are."""
    batch = a.shape[:-2]
    a3, b3 = (t.reshape(-1, *t.shape[-2:]) for t in (a, b))
    a3, b3 = (t if t.stride(-1) == 1 else t.contiguous() for t in (a3, b3))
    out = torch.bmm(a3, b3)
    return out.reshape(*batch, *out.shape[-2:])


def _pad(t: Tensor, dim: int, multiple: int, value: float = 0.0) -> Tensor:
    """``t`` padded with ``value`` along ``dim`` to a multiple of ``multiple`` (always a new tensor)."""
    extra = -t.shape[dim] % multiple
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t, t.new_full(shape, value)], dim=dim)


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
    """``merged_block`` (attention.py) with every call's shape fixed. z: [X ; C] (B, T+K, D)."""
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
    o = in_blocks(lambda *t: base_attention(attn, *t), blocks.images, q[:, :, :T], k_x, v_x)  # (B, H, T, d)
    if N > T and isinstance(memory, SlotAttention):  # the Triton kernel: a row's result is its own
        rows = z.new_empty(B, N, attn.num_heads, attn.head_dim)
        memory.into(rows, attn, q, k, v, T)
        o = torch.cat([o, rows[:, T:].transpose(1, 2)], dim=2)
    elif N > T:
        o_c = adapter_attention(attn, q[:, :, T:], k[:, :, T:], v[:, :, T:], k_x, v_x, memory, blocks)
        o = torch.cat([o, o_c], dim=2)
    o = o.transpose(1, 2).reshape(B * N, D)

    def finish(rows: Tensor, o_rows: Tensor, h_rows: Tensor | None = None) -> Tensor:
        return _finish(block, rows, h_rows, o_rows)

    parts = (z.reshape(B * N, D), o) if h is None else (z.reshape(B * N, D), o, h)
    return in_blocks(finish, blocks.rows, *parts).reshape(B, N, D)


def adapter_attention(
    attn: Attention,
    q_c: Tensor,
    k_c: Tensor,
    v_c: Tensor,
    k_x: Tensor,
    v_x: Tensor,
    memory: LayerMemory,
    blocks: InvariantBlocks,
) -> Tensor:
    """``attention.adapter_attention`` computed so that a row's result depends on that row alone.

    q_c, k_c, v_c: (B, H, K, d); k_x, v_x: (B, H, T, d). Returns (B, H, K, d).
    """
    B, H, K, d = q_c.shape
    T = k_x.shape[2]
    wide = torch.promote_types(q_c.dtype, torch.float32)  # the softmax's dtype, as in the default pass
    q = (q_c * attn.scale).to(wide)
    k_x, v_x = k_x.to(wide), v_x.to(wide)
    # Values with a column of ones: one product gives the weighted values and the weights' sum.
    v_x1 = torch.cat([v_x, v_x.new_ones(B, H, T, 1)], dim=-1)  # (B, H, T, d+1)
    k_xt = k_x.transpose(-2, -1).contiguous()  # (B, H, d, T)
    # Base keys: queries in fixed chunks of `thin` rows per image (K padded with zero queries).
    q_p = _pad(q, 2, blocks.thin)
    chunks = range(0, q_p.shape[2], blocks.thin)
    s_x = torch.cat(
        [in_blocks(_bmm, blocks.images, q_p[:, :, j : j + blocks.thin], k_xt) for j in chunks], dim=2
    )[:, :, :K]  # (B, H, K, T)
    # Own keys (lineage, memory), one entry per class-token row (B*K), in fixed chunks of keys.
    top = _rows_first(s_x.amax(dim=-1, keepdim=True)).squeeze(-1)  # (B*K, H)
    q_rows = _rows_first(q).unsqueeze(-1)  # (B*K, H, d, 1)
    own = []  # per chunk: scores plus bias (B*K, H, c), values and a column of ones (B*K, H, c, d+1)
    for keys, values, bias in _own_keys(k_c, v_c, memory, B):
        c = blocks.keys
        keys, values, bias = _pad(keys, 2, c), _pad(values, 2, c), _pad(bias, 2, c, float("-inf"))
        values = torch.cat([values, values.new_ones(*values.shape[:-1], 1)], dim=-1).to(wide)
        for j in range(0, keys.shape[2], c):
            s = in_blocks(_bmm, blocks.batches, keys[:, :, j : j + c].to(wide), q_rows).squeeze(-1)
            s = s + bias[..., j : j + c]
            top = torch.maximum(top, s.amax(dim=-1))  # the max is exact in any order
            own.append((s, values[:, :, j : j + c]))
    # Softmax from its pieces: exponentials, and sums taken by the products of the weighted values.
    e_x = _pad((s_x - _heads_first(top, B)[..., None]).exp(), 2, blocks.thin)
    o = torch.cat(
        [in_blocks(_bmm, blocks.images, e_x[:, :, j : j + blocks.thin], v_x1) for j in chunks], dim=2
    )[:, :, :K]  # (B, H, K, d+1)
    o = _rows_first(o)  # (B*K, H, d+1)
    for s, values in own:
        e = (s - top[..., None]).exp().unsqueeze(2)  # (B*K, H, 1, c); padding: exp(-inf) = 0 adds 0
        o = o + in_blocks(_bmm, blocks.batches, e, values).squeeze(2)
    return _heads_first((o[..., :d] / o[..., d:]).to(q_c.dtype), B)


def _rows_first(t: Tensor) -> Tensor:
    """(B, H, K, ...) -> (B*K, H, ...): one entry per class-token row, so rows can be blocked."""
    B, H, K = t.shape[:3]
    return t.transpose(1, 2).reshape(B * K, H, *t.shape[3:])


def _heads_first(t: Tensor, B: int) -> Tensor:
    """(B*K, H, ...) -> (B, H, K, ...), undoing ``_rows_first``."""
    return t.reshape(B, -1, *t.shape[1:]).transpose(1, 2)


def _own_keys(k_c: Tensor, v_c: Tensor, memory: LayerMemory, B: int) -> list[tuple[Tensor, Tensor, Tensor]]:
    """Per class-token row, its lineage's and its memory's keys and values (B*K, H, n, d) and the
    bias on them (B*K, 1, n): -inf on padding."""
    _, H, K, d = k_c.shape
    if memory.lineage.ndim == 2:  # shared by every image
        k_l, v_l = k_c[:, :, memory.lineage].transpose(1, 2), v_c[:, :, memory.lineage].transpose(1, 2)
        l_bias = memory.lineage_bias.expand(B, -1, -1)  # (B, K, A)
        k_m = memory.keys.expand(B, -1, -1, -1, -1)  # (K, H, P, d) -> (B, K, H, P, d)
        v_m = memory.values.expand(B, -1, -1, -1, -1)
        m_bias = memory.bias.expand(B, -1, -1)
    else:  # routed: row k of image b is adapter idx[b, k]
        images = torch.arange(B, device=k_c.device)[:, None, None]
        k_l = k_c.transpose(1, 2)[images, memory.lineage].transpose(2, 3)  # (B, K, H, A, d)
        v_l = v_c.transpose(1, 2)[images, memory.lineage].transpose(2, 3)
        l_bias, k_m, v_m, m_bias = memory.lineage_bias, memory.keys, memory.values, memory.bias
    k_l, v_l, k_m, v_m = (t.reshape(B * K, H, -1, d) for t in (k_l, v_l, k_m, v_m))
    return [(k_l, v_l, l_bias.reshape(B * K, 1, -1)), (k_m, v_m, m_bias.reshape(B * K, 1, -1))]


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


def linear(x: Tensor, weight: Tensor, bias: Tensor, blocks: InvariantBlocks) -> Tensor:
    """``F.linear`` on fixed blocks of rows (a routed adapter's head)."""
    return in_blocks(lambda r: F.linear(r, weight, bias), blocks.thin, x)
