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

    def copy(self, source: Tensor, target: Tensor, *, stream: torch.cuda.Stream | None = None) -> Tensor:
        """Queue ``target.copy_(source)`` (``source`` on the host, ``target`` on a CUDA device) on
        ``stream`` (the current one by default), through a pinned buffer; returns ``target``."""
        slot, staged = self.stage(source.shape, source.dtype)
        staged.copy_(source)
        return self.send(slot, staged, target, stream=stream)

    def stage(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> tuple[int, Tensor]:
        """The next pinned buffer, as a view of ``shape``: fill it, then ``send`` it. Waits (rarely) for
        the copy that last read it."""
        n = 1
        for side in shape:
            n *= side
        with self._lock:
            i = self._next
            self._next = (i + 1) % len(self._buffers)
            event = self._events[i]
            if event is not None:
                event.synchronize()  # the copy that last read this buffer has run
                self._events[i] = None
            buffer = self._buffers[i]
            if buffer is None or buffer.dtype != dtype or buffer.numel() < n:
                buffer = self._buffers[i] = torch.empty(max(n, 1024), dtype=dtype, pin_memory=True)
        return i, buffer[:n].view(shape)

    def send(
        self, slot: int, staged: Tensor, target: Tensor, *, stream: torch.cuda.Stream | None = None
    ) -> Tensor:
        """Queue ``target.copy_(staged)`` on ``stream``, ``staged`` being buffer ``slot``'s view."""
        stream = stream or torch.cuda.current_stream(target.device)
        with torch.cuda.stream(stream):
            target.copy_(staged, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        self._events[slot] = event
        return target
