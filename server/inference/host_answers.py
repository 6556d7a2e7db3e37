"""A CPU batch's answers (server/inference/answers.py), in numpy: the table is on the host already.

torch's CPU softmax forks its intra-op thread pool whatever the size of its input (a parallel loop of
grain 0): for a table of a few dozen rows, the fork and the join cost a busy machine more than the rest
of the batch's answers together (py-spy of the model process under load, the pass stubbed: 39% of its
engine thread, spinning at the join). numpy's reductions here run on the calling thread, and a row's
answer is computed from that row alone, whatever else is in the table.
"""

from __future__ import annotations

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
    classes, never chosen), and ``logits``, when asked for."""
    out = {"finite": np.isfinite(table).all(-1)}
    if logits:
        out["logits"] = table
    if k > 0:
        masked = table if padding is None else np.where(padding, -np.inf, table)
        index = _top_k(masked, k)
        with np.errstate(invalid="ignore", over="ignore"):  # a non-finite row: refused, never read
            shifted = np.exp(masked - masked.max(-1, keepdims=True))
            out["probs"] = np.take_along_axis(shifted, index, -1) / shifted.sum(-1, keepdims=True)
        out["index"] = index.astype(np.int64, copy=False)
    return out


def _top_k(masked: np.ndarray, k: int) -> np.ndarray:
    """(rows, k) each row's k largest columns, largest first; equal values: the lower class first."""
    if k == 1:
        return masked.argmax(-1)[:, None]  # its first largest
    part = np.argpartition(masked, masked.shape[1] - k, axis=-1)[:, -k:]  # the k largest, unordered
    values = np.take_along_axis(masked, part, -1)
    kth = values.min(-1, keepdims=True)
    # More classes equal to the k-th value than were kept: which were is the partition's choice, so
    # those rows (rare: ties in logits) take the first ones in a stable sort of the row.
    tied = (masked == kth).sum(-1) > (values == kth).sum(-1)
    if tied.any():
        part[tied] = np.argsort(-masked[tied], axis=-1, kind="stable")[:, :k]
        values = np.take_along_axis(masked, part, -1)
    return np.take_along_axis(part, np.lexsort((part, -values), axis=-1), -1)
