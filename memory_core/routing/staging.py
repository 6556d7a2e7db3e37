"""Host-to-device copies that never make the host wait: host buffers reused once their copy has run.

A copy from pageable host memory is staged by the driver and returns only when it is done; from
pinned (page-locked) memory it is queued on the stream and the host goes on. Pinning is slow
(``cudaHostAlloc``), so buffers are kept, a ring per size, and each carries one event, created with
it and recorded after every copy that reads it. A buffer is written again only once its event has
completed, which the host asks (``event.query()``) and never waits for: when every buffer of a size
is still being read, the ring grows by one. In steady state a ring holds as many buffers as copies
are in flight, and a copy costs no allocation, no event creation and no host sync.

Off CUDA the buffers are plain memory, the copy is done when it returns, and there are no events. A
benchmark of the host path (benchmarks/host_path.py) gives its own event factory to count them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger(__name__)

_FREE, _HELD, _FLYING = 0, 1, 2


class HostBuffer:
    """One host buffer (pinned on CUDA), a numpy view of it, and the event of its last copy."""

    __slots__ = ("array", "event", "state", "tensor")

    def __init__(self, tensor: Tensor, event: Any) -> None:
        self.tensor = tensor  # 1-d
        self.array = tensor.numpy()  # the same memory: the plan is written here, in numpy
        self.event = event  # None off CUDA
        self.state = _FREE

    def ready(self) -> bool:
        """Free, or its last copy has run (asked, not waited for)."""
        if self.state == _FLYING and self.event.query():
            self.state = _FREE
        return self.state == _FREE


class HostBuffers:
    """Rings of host buffers per (length, dtype), for copies queued on a device's stream."""

    def __init__(self, *, pinned: bool | None = None, new_event: Callable[[], Any] | None = None) -> None:
        cuda = torch.cuda.is_available()
        self.pinned = cuda if pinned is None else pinned
        self.new_event = new_event if new_event is not None else (torch.cuda.Event if cuda else None)
        self._rings: dict[tuple[int, torch.dtype], list[HostBuffer]] = {}
        self._streams: dict[tuple[int, int], Any] = {}  # (device index, raw handle) -> its Stream
        self._lock = threading.Lock()

    def acquire(self, n: int, dtype: torch.dtype = torch.int64) -> HostBuffer:
        """A buffer of ``n`` elements to fill, then ``send`` (or ``release``). Never waits."""
        with self._lock:
            ring = self._rings.setdefault((n, dtype), [])
            for buffer in ring:
                if buffer.ready():
                    buffer.state = _HELD
                    return buffer
            tensor = torch.empty(max(n, 1), dtype=dtype, pin_memory=self.pinned)[:n]
            buffer = HostBuffer(tensor, self.new_event() if self.new_event is not None else None)
            buffer.state = _HELD
            ring.append(buffer)
            if len(ring) > 8:
                log.debug("%d host buffers of %d %s in flight", len(ring), n, dtype)
            return buffer

    def send(self, buffer: HostBuffer, target: Tensor, *, stream: Any = None) -> Tensor:
        """Queue ``target.copy_(buffer)`` on ``stream`` (the target device's current stream by
        default); the buffer is free again once the copy has run. Returns ``target``."""
        source = buffer.tensor if target.shape == buffer.tensor.shape else buffer.tensor.view(target.shape)
        if buffer.event is None:  # plain memory, no events: the copy is done when it returns
            target.copy_(source)
            buffer.state = _FREE
            return target
        if stream is not None and target.device.type == "cuda":
            with torch.cuda.stream(stream):
                target.copy_(source, non_blocking=True)
                buffer.event.record(stream)
        elif target.device.type == "cuda":  # the current stream: no context to enter
            target.copy_(source, non_blocking=True)
            buffer.event.record(self._current_stream(target.device))
        else:  # a stand-in device (benchmarks/host_path.py)
            target.copy_(source, non_blocking=True)
            buffer.event.record()
        buffer.state = _FLYING
        return target

    def _current_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The stream now current on ``device``. ``torch.cuda.current_stream()`` (what
        ``Event.record()`` calls) builds a new Stream object through several Python calls on every
        pass; one C call gives the raw handle, and the object made for it is kept."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        raw = torch._C._cuda_getCurrentRawStream(index)
        stream = self._streams.get((index, raw))
        if stream is None:
            if len(self._streams) > 64:  # streams come and go (a caller's own): keep the map small
                self._streams.clear()
            stream = self._streams[index, raw] = torch.cuda.current_stream(index)
        return stream

    def release(self, buffer: HostBuffer | None) -> None:
        """Give back a buffer that was not sent (None: nothing to give back)."""
        if buffer is not None and buffer.state == _HELD:
            buffer.state = _FREE

    def __len__(self) -> int:
        return sum(len(ring) for ring in self._rings.values())


class PinnedStaging:
    """Stage a host tensor for a copy to the device (server/inference/device_runner.py's images)."""

    def __init__(self, buffers: HostBuffers | None = None) -> None:
        self.buffers = buffers if buffers is not None else HostBuffers()

    def stage(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> tuple[HostBuffer, Tensor]:
        """A host buffer viewed as ``shape``: fill the view, then ``send`` it. Never waits."""
        n = 1
        for side in shape:
            n *= side
        buffer = self.buffers.acquire(n, dtype)
        return buffer, buffer.tensor.view(shape)

    def send(
        self, slot: HostBuffer, staged: Tensor, target: Tensor, *, stream: torch.cuda.Stream | None = None
    ) -> Tensor:
        """Queue ``target.copy_(staged)`` on ``stream``, ``staged`` being ``slot``'s view."""
        return self.buffers.send(slot, target, stream=stream)

    def copy(self, source: Tensor, target: Tensor, *, stream: torch.cuda.Stream | None = None) -> Tensor:
        """``target.copy_(source)`` through a host buffer, queued without waiting."""
        slot, staged = self.stage(source.shape, source.dtype)
        staged.copy_(source)
        return self.send(slot, staged, target, stream=stream)
