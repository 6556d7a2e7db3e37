"""A CPU batch's answers (server/inference/answers.py), in numpy: the table is on the host already.

torch's CPU softmax forks its intra-op thread pool whatever the size of its input (a parallel loop of
grain 0). The fork itself is cheap; what it costs is libgomp's worker, which spins after every
parallel region waiting for the next: a batch of five answered every millisecond kept it spinning all
the time, doubling the process's CPU for the batch (pass stubbed, 32x32 JPEGs: 1.4-1.6 ms of process
CPU per batch against 0.7-0.8 of the batch's own thread; in numpy, 0.9-1.0 and nothing beside). A
busy machine pays it too: the spin takes a core from the other processes. Here only a top-k of more
than one class over more than 32,768 logits forks (torch's top-k, whose grain is sized), and a row's
answer is computed from that row alone, whatever else is in the table.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from torch import Tensor


def table_on_host(base: Tensor, flat: Tensor | None, width: int) -> np.ndarray:
    """(N + B, width) float32: every row the batch computed, the base's last, at ``width`` columns."""
    parts = [(t if t.dtype == torch.float32 else t.float()).numpy() for t in (flat, base) if t is not None]
    if all(a.dtype == np.float32 and a.shape[1] == width for a in parts):
        return np.concatenate(parts) if len(parts) > 1 else parts[0]
    table = np.zeros((sum(a.shape[0] for a in parts), width), dtype=np.float32)
    row = 0
    for a in parts:
        cut = min(a.shape[1], width)
        table[row : row + a.shape[0], :cut] = a[:, :cut]
        row += a.shape[0]
    return table


def host_answers(
    table: np.ndarray, padding: np.ndarray | None, k: int, logits: bool
) -> dict[str, np.ndarray]:
    """The arrays ``BatchAnswers.cut`` reads: ``finite`` per row, ``probs`` and ``index`` (each row's
    softmax at its ``k`` most probable classes; ``padding``: True where a row's column is past its
    classes, never chosen), and ``logits``, when asked for. The ufuncs' own reductions, not the
    array methods' Python wrappers: a few microseconds each at these sizes."""
    finite = _ALL(np.isfinite(table), axis=-1)
    out = {"finite": finite}
    if logits:
        out["logits"] = table
    if k > 0:
        masked = table if padding is None else np.where(padding, -np.inf, table)
        index, values = _top_k(masked, k)
        peak = values[:, :1]  # each row's largest
        with np.errstate(invalid="ignore", over="ignore") if not _ALL(finite) else _QUIET:
            total = _SUM(np.exp(masked - peak), axis=-1, keepdims=True)  # (rows, 1)
            # The top-1's probability is exp(0) / total: one division; the rest exp(v - peak) / total.
            out["probs"] = 1.0 / total if k == 1 else np.exp(values - peak) / total
        out["index"] = index
    return out


def _top_k(masked: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, k) each row's k largest columns and their values, largest first. Top-1 is the row's first
    largest; for more, torch's top-k (its loop forks the thread pool only for thousands of rows'
    worth of columns), which orders equal values its own way, the same for a row in any batch."""
    if k == 1:
        return masked.argmax(-1)[:, None], _MAX(masked, axis=-1, keepdims=True)
    values, index = torch.from_numpy(masked).topk(k, dim=-1)
    return index.numpy(), values.numpy()


_ALL, _SUM, _MAX = np.logical_and.reduce, np.add.reduce, np.maximum.reduce
_QUIET = contextlib.nullcontext()
