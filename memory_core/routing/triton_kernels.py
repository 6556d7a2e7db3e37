"""Triton kernels for the slot pass: the adapter attention of one block, and the gathered heads.

``class_token_attention_kernel`` is the class-token rows' attention of one block in one kernel: each row of
image b reads that image's T base keys and values, its lineage's class-token keys (itself, plus its
ancestors' in extension mode) and its slot's memory keys and values from the pool, wherever each lies
(beside the base rows in one projection, or apart), with one online softmax over all of them (flash
attention's running max and sum, in float32). One program handles a tile of rows of one image and
head, so the image's base keys are read once per tile, through the tensor cores; rows tile by 16 or
more, so a pass with one row per image wastes MMA lanes, not loads. The tiles' sizes and warps are
kernel_tiles.py's: every value a program holds in registers on sm_90, none spilled.
Memory is read only up to the longest real memory in the tile (``memory_length``), so a long memory
elsewhere in the pool costs the other rows nothing.

``gathered_heads`` applies each output row's head, found by its slot in the head pool (vLLM's and
Punica's BGMV): no head is copied, and any mix of tasks is one launch. ``shared_heads`` is the
all-tasks layout's: every row's head applied to every image, one launch, each head read once per
tile of images where it lies in the pool (SGMV), instead of gathering every head into a copy.

Both run on CUDA tensors as compiled kernels and on CPU tensors through Triton's interpreter, which
is how CI holds them to the dense reference without a GPU (slow: tests use tiny shapes). The torch
implementation of the same two operations is memory_core/routing/planned.py's; docs/design.md §2.10.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .kernel_tiles import attention_tiles, gathered_head_tiles, shared_head_tiles

try:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # pragma: no cover - triton ships with CUDA builds of torch
    triton = None

launches = 0  # kernels launched since import: the tests' way to count them with the aten ops


def available() -> bool:
    """Whether Triton is importable here (CUDA builds of torch ship it)."""
    return triton is not None


if triton is not None:

    @triton.jit
    def _class_token_attention_jit(
        q_ptr, kc_ptr, vc_ptr, o_ptr,  # the rows' q, k, v: (B, H, R, d); o: (B, R, H, d)
        k_ptr, v_ptr,  # the base keys and values: (B, H, T, d)
        mk_ptr, mv_ptr, mlen_ptr,  # memory pools (S, H, P, d) and lengths (S,)
        slot_ptr, lin_ptr,  # row slots (B, R), lineage (B, R, A)
        T, R, d, scale,
        sqb, sqh, sqn, sqd, skcb, skch, skcn, skcd, svcb, svch, svcn, svcd, sob, son, soh, sod,
        skb, skh, skn, skd, svb, svh, svn, svd,
        sms, smh, smp, smd, svs, svmh, svp, svmd, ssb, ssr, slb, slr, sla,
        A: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        # Row tiles vary fastest, so the programs reading one image's keys run together (L2).
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        h = tl.program_id(1)
        b = tl.program_id(2)
        dd = tl.arange(0, BLOCK_D)
        rmask = r < R
        dmask = dd < d
        q_rows = q_ptr + b * sqb + h * sqh + r[:, None] * sqn + dd[None, :] * sqd
        q = tl.load(q_rows, mask=rmask[:, None] & dmask[None, :], other=0.0).to(tl.float32) * scale
        m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        # The image's base keys, a tile at a time.
        for t0 in range(0, T, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            tmask = t < T
            kv_mask = tmask[:, None] & dmask[None, :]
            k = tl.load(
                k_ptr + b * skb + h * skh + t[:, None] * skn + dd[None, :] * skd, mask=kv_mask, other=0.0
            )
            if BLOCK_R >= 16:  # the tensor cores (tl.dot needs 16 rows)
                s = tl.dot(q.to(k.dtype), tl.trans(k), input_precision="ieee")  # (BLOCK_R, BLOCK_T) fp32
            else:  # one row: each score is its own sum, in a fixed order (the batch-invariant mode)
                s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], 2)
            s = tl.where(tmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_ptr + b * svb + h * svh + t[:, None] * svn + dd[None, :] * svd, mask=kv_mask, other=0.0
            )
            if BLOCK_R >= 16:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], 1)
            m_i = m_new
        # The class tokens of the row's lineage: itself first, then its ancestors (extension mode).
        for a in tl.static_range(A):
            if A == 1:  # noqa: SIM108 - a compile-time branch: the load exists only when A > 1
                pos = r
            else:
                pos = tl.load(lin_ptr + b * slb + r * slr + a * sla, mask=rmask, other=-1)
            valid = rmask & (pos >= 0)
            own_mask = valid[:, None] & dmask[None, :]
            k_a = tl.load(kc_ptr + b * skcb + h * skch + pos[:, None] * skcn + dd[None, :] * skcd,
                          mask=own_mask, other=0.0).to(tl.float32)  # fmt: skip
            s_a = tl.where(valid, tl.sum(q * k_a, 1), float("-inf"))
            m_new = tl.maximum(m_i, s_a)
            alpha = tl.exp(m_i - m_new)
            p_a = tl.exp(s_a - m_new)
            l_i = l_i * alpha + p_a
            v_a = tl.load(vc_ptr + b * svcb + h * svch + pos[:, None] * svcn + dd[None, :] * svcd,
                          mask=own_mask, other=0.0).to(tl.float32)  # fmt: skip
            acc = acc * alpha[:, None] + p_a[:, None] * v_a
            m_i = m_new
        # The row's slot's memory, up to the longest real memory among the tile's rows.
        slot = tl.load(slot_ptr + b * ssb + r * ssr, mask=rmask, other=0)
        length = tl.where(rmask, tl.load(mlen_ptr + slot), 0)
        for p0 in range(0, tl.max(length, 0), BLOCK_P):
            pp = p0 + tl.arange(0, BLOCK_P)
            pmask = pp[None, :] < length[:, None]  # (BLOCK_R, BLOCK_P)
            m_mask = pmask[:, :, None] & dmask[None, None, :]
            offs = slot[:, None, None] * sms + h * smh + pp[None, :, None] * smp + dd[None, None, :] * smd
            k_m = tl.load(mk_ptr + offs, mask=m_mask, other=0.0).to(tl.float32)  # (BLOCK_R, BLOCK_P, BLOCK_D)
            s_m = tl.where(pmask, tl.sum(q[:, None, :] * k_m, 2), float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s_m, 1))
            alpha = tl.exp(m_i - m_new)
            p_m = tl.exp(s_m - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p_m, 1)
            offs = slot[:, None, None] * svs + h * svmh + pp[None, :, None] * svp + dd[None, None, :] * svmd
            v_m = tl.load(mv_ptr + offs, mask=m_mask, other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.sum(p_m[:, :, None] * v_m, 1)
            m_i = m_new
        out = acc / l_i[:, None]
        o_rows = o_ptr + b * sob + r[:, None] * son + h * soh + dd[None, :] * sod
        tl.store(o_rows, out.to(o_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])

    @triton.jit
    def _gathered_heads_kernel(
        c_ptr, rows_ptr, slots_ptr, w_ptr, bias_ptr, out_ptr,
        C, D, scn, scd, sws, swc, swd, sbs, sbc, son, soc,
        BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        n = tl.program_id(0)
        cc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cc < C
        row = tl.load(rows_ptr + n)
        slot = tl.load(slots_ptr + n)
        acc = tl.zeros([BLOCK_C], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            dd = d0 + tl.arange(0, BLOCK_D)
            dmask = dd < D
            x = tl.load(c_ptr + row * scn + dd * scd, mask=dmask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + slot * sws + cc[:, None] * swc + dd[None, :] * swd,
                        mask=cmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)  # fmt: skip
            acc += tl.sum(w * x[None, :], 1)
        acc += tl.load(bias_ptr + slot * sbs + cc * sbc, mask=cmask, other=0.0).to(tl.float32)
        tl.store(out_ptr + n * son + cc * soc, acc.to(out_ptr.dtype.element_ty), mask=cmask)

    @triton.jit
    def _shared_heads_kernel(
        c_ptr, slots_ptr, w_ptr, bias_ptr, out_ptr,
        B, C, D, scb, scr, scd, sws, swc, swd, sbs, sbc, sor, sob, soc,
        BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        # Row r's head, read where it lies in the pool, applied to a tile of images on the tensor cores.
        r = tl.program_id(0)
        cc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        bb = tl.program_id(2) * BLOCK_B + tl.arange(0, BLOCK_B)
        cmask, bmask = cc < C, bb < B
        slot = tl.load(slots_ptr + r)
        acc = tl.zeros([BLOCK_B, BLOCK_C], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            dd = d0 + tl.arange(0, BLOCK_D)
            dmask = dd < D
            x = tl.load(c_ptr + bb[:, None] * scb + r * scr + dd[None, :] * scd,
                        mask=bmask[:, None] & dmask[None, :], other=0.0)  # fmt: skip
            w = tl.load(w_ptr + slot * sws + cc[:, None] * swc + dd[None, :] * swd,
                        mask=cmask[:, None] & dmask[None, :], other=0.0)  # fmt: skip
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        acc += tl.load(bias_ptr + slot * sbs + cc * sbc, mask=cmask, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + r * sor + bb[:, None] * sob + cc[None, :] * soc
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=bmask[:, None] & cmask[None, :])


def _launcher(kernel, device: torch.device):
    """``kernel`` for tensors on ``device``: compiled on CUDA; on CPU, only as Triton's interpreter
    runs it, which ``TRITON_INTERPRET=1`` set before Triton is first imported selects (the tests do)."""
    global launches
    if device.type != "cuda" and not isinstance(kernel, InterpretedFunction):
        raise RuntimeError(
            "the Triton kernels run CPU tensors only under Triton's interpreter: set TRITON_INTERPRET=1 "
            "before importing memvit, or use kernels='torch' on CPU"
        )
    launches += 1
    return kernel


def class_token_attention_kernel(
    o: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    base_keys: Tensor,
    base_values: Tensor,
    memory_keys: Tensor,
    memory_values: Tensor,
    memory_length: Tensor,
    row_slots: Tensor,
    lineage: Tensor | None,
    scale: float,
    *,
    block_rows: int | None = None,
) -> None:
    """Write the R class-token rows' attention output into ``o`` (B, R, H, d).

    q, k, v: the rows' (B, H, R, d); base_keys/values: the base rows' (B, H, T, d); any strides (views
    of a block's qkv projection); memory_keys/values: one layer's pools (S, H, P, d); memory_length
    (S,); row_slots (B, R), a stride-0 view when every image has the same rows; lineage (B, R, A) row
    positions, -1 on padding, or None for concatenation mode (each row's own key alone). ``block_rows``:
    rows per program, 1 or 16 to 64; None picks by R. A tile of 16 or more scores its rows on the
    tensor cores, whose rounding of a row need not be independent of its place in the tile; one row
    per program sums every score in a fixed order of its own, which the batch-invariant mode relies on.
    """
    B, H, R, d = q.shape
    T = base_keys.shape[2]
    if R == 0:
        return
    A = 1 if lineage is None else lineage.shape[-1]
    lin = row_slots.unsqueeze(-1) if lineage is None else lineage  # unread when A == 1
    tile = attention_tiles(R, d, q.dtype, block_rows)  # kernel_tiles.py: nothing spilled on sm_90
    grid = (triton.cdiv(R, tile.rows), H, B)
    _launcher(_class_token_attention_jit, q.device)[grid](
        q, k, v, o, base_keys, base_values, memory_keys, memory_values, memory_length, row_slots, lin,
        T, R, d, scale,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(), *base_keys.stride(), *base_values.stride(),
        *memory_keys.stride(), *memory_values.stride(), *row_slots.stride(), *lin.stride(),
        A=A, BLOCK_R=tile.rows, BLOCK_T=tile.keys, BLOCK_P=tile.memory, BLOCK_D=tile.features,
        num_warps=tile.warps,
    )  # fmt: skip


def gathered_heads(
    c: Tensor, out_rows: Tensor, out_slots: Tensor, head_weight: Tensor, head_bias: Tensor
) -> Tensor:
    """Output n = row ``out_rows[n]`` of ``c`` (M, D) through head ``out_slots[n]`` of the pool
    (S, C, D) / (S, C). Returns (N, C) in ``c``'s dtype."""
    N = out_rows.shape[0]
    _, C, D = head_weight.shape
    out = c.new_empty(N, C)
    if N == 0:
        return out
    BLOCK_C, BLOCK_D = gathered_head_tiles(C, D)
    grid = (N, triton.cdiv(C, BLOCK_C))
    _launcher(_gathered_heads_kernel, c.device)[grid](
        c, out_rows, out_slots, head_weight, head_bias, out,
        C, D, *c.stride(), *head_weight.stride(), *head_bias.stride(), *out.stride(),
        BLOCK_C=BLOCK_C, BLOCK_D=BLOCK_D,
    )  # fmt: skip
    return out


def shared_heads(c: Tensor, row_slots: Tensor, head_weight: Tensor, head_bias: Tensor) -> Tensor:
    """Final class tokens (B, R, D), row r's head (slot ``row_slots[r]`` of the pool (S, C, D) / (S, C))
    applied to every image -> (R, B, C): one launch for every row, each head read in place (Punica's
    SGMV: no head is copied, whatever the number of rows)."""
    B, R, D = c.shape
    C = head_weight.shape[1]
    out = c.new_empty(R, B, C)
    if R == 0 or B == 0:
        return out
    BLOCK_B, BLOCK_C, BLOCK_D = shared_head_tiles(B, C, D, c.dtype)
    grid = (R, triton.cdiv(C, BLOCK_C), triton.cdiv(B, BLOCK_B))
    _launcher(_shared_heads_kernel, c.device)[grid](
        c, row_slots, head_weight, head_bias, out,
        B, C, D, *c.stride(), *head_weight.stride(), *head_bias.stride(), *out.stride(),
        BLOCK_B=BLOCK_B, BLOCK_C=BLOCK_C, BLOCK_D=BLOCK_D,
    )  # fmt: skip
    return out
