"""Host-to-device copies that do not make the host wait: small pinned buffers, reused in turn.

A copy from pageable host memory is staged by the driver and returns only when it is done; from
pinned (page-locked) memory it is queued on the stream and the host goes on. Pinning is slow
(``cudaHostAlloc``), so the buffers are kept and reused round-robin; a buffer is written again only
after the copy that last read it has run (an event per buffer, almost always long past).
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor


class PinnedStaging:
    """A ring of pinned host buffers for ``copy`` to a CUDA device."""

    def __init__(self, buffers: int = 4) -> None:
        self._buffers: list[Tensor | None] = [None] * buffers
        self._events: list[torch.cuda.Event | None] = [None] * buffers
        self._next = 0
        self._lock = threading.Lock()

    def copy(self, source: Tensor, target: Tensor) -> Tensor:
        """Queue ``target.copy_(source)`` (``source`` on the host, ``target`` on a CUDA device) on the
        current stream, through a pinned buffer; returns ``target``."""
        n = source.numel()
        with self._lock:
            i = self._next
            self._next = (i + 1) % len(self._buffers)
            event = self._events[i]
            if event is not None:
                event.synchronize()  # the copy that last read this buffer has run
            buffer = self._buffers[i]
            if buffer is None or buffer.dtype != source.dtype or buffer.numel() < n:
                buffer = self._buffers[i] = torch.empty(max(n, 1024), dtype=source.dtype, pin_memory=True)
            staged = buffer[:n].view(source.shape)
            staged.copy_(source)
            target.copy_(staged, non_blocking=True)
            event = self._events[i] = torch.cuda.Event()
            event.record()
        return target
