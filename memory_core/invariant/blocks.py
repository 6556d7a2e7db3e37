"""The batch-invariant mode's fixed call sizes (``InvariantBlocks``, per device) and the helpers
that run a call on fixed blocks of rows whatever the batch (``in_blocks``, ``fixed_bmm``,
``pad_up``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


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
    # Class-token rows per program of the Triton attention kernel. One: each row's sums its own, in a
    # fixed order. 16: a tile of rows scored on the tensor cores, fixed whatever the plan's row count,
    # invariant if the device's matrix units round a row independently of the tile's other rows
    # (they did on an H200: the CUDA default).
    kernel_rows: int = 1

    @classmethod
    def for_device(cls, device: torch.device, dtype: torch.dtype | None = None) -> InvariantBlocks:
        if device.type == "cuda" and dtype == torch.float32:
            # float32 (TF32 convolutions, cuBLAS's float32 kernels) did not hold with the per-token
            # layers and the patch embedding left whole (H200, DeiT-Tiny and ViT-B/16); these held
            # at 0.74-0.81 of the default mode's speed (benchmarks/RESULTS.md §1.6). The Triton
            # attention on 16-row tiles held too, at 0.75-0.80 (the base-only pass's own 0.75 is the
            # blocked token rows, not the tile).
            return cls(rows=8192, thin=64, keys=8, images=32, batches=4096, kernel_rows=16)
        if device.type == "cuda":
            # What changes with the batch on an H200 (the GPU suite's op probe): the thin products
            # (class-token scores, memory einsums over images, heads on few rows), which stay
            # blocked. The per-token layers and the base attention were invariant by themselves,
            # and left whole they held (base and routed adapters, image 0 alone against batches of
            # 2, 7 and 64, bf16) at 0.985 (DeiT-Tiny) and 0.996 (ViT-B/16) of the default mode's
            # speed, against 0.50-0.72 with them blocked by 4,096 rows (benchmarks/RESULTS.md §1.6).
            # The Triton attention on a fixed 16-row tile (the tensor cores) held on base, routed and
            # all-tasks passes, and lifted the all-tasks pass from 0.69-0.72 to 0.95-0.96 of the
            # default mode (H200, bf16, batch 64, DeiT-Tiny and ViT-B/16).
            return cls(rows=None, thin=64, keys=8, images=None, batches=4096, kernel_rows=16)
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


def fixed_bmm(a: Tensor, b: Tensor) -> Tensor:
    """(..., m, k) @ (..., k, n) as one bmm, each matrix's rows contiguous: the layout BLAS sees, and
    with it the kernel, never depends on how many matrices there are."""
    batch = a.shape[:-2]
    a3, b3 = (t.reshape(-1, *t.shape[-2:]) for t in (a, b))
    a3, b3 = (t if t.stride(-1) == 1 else t.contiguous() for t in (a3, b3))
    out = torch.bmm(a3, b3)
    return out.reshape(*batch, *out.shape[-2:])


def pad_up(t: Tensor, dim: int, multiple: int, value: float = 0.0) -> Tensor:
    """``t`` padded with ``value`` along ``dim`` to a multiple of ``multiple`` (always a new tensor)."""
    extra = -t.shape[dim] % multiple
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t, t.new_full(shape, value)], dim=dim)
