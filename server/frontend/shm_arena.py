"""A ring of shared memory that one process writes payloads into and another reads them from.

An API process (server/frontend/) hands the model process every upload of a request: 100 KB of JPEG,
or 600 KB of a decoded image, thousands of times a second. Through a socket each would be copied
into the kernel and out again; through shared memory the API process writes it once and the model
process reads it where it lies (``torch.frombuffer`` over the mapping). The writer owns its arena:
it allocates a region per payload, passes ``(arena, offset, length)`` over the socket, and frees
the region when the answer comes back. Regions are freed in any order and reused in ring order; a
payload that does not fit (an arena full of requests in flight) returns None, and the caller sends
it inline instead: slower, never refused.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory


@dataclass(frozen=True)
class Ticket:
    """Where a payload lies: which arena, where in it, how long."""

    arena: str
    offset: int
    length: int


class Arena:
    """A writer's ring of shared memory (``size`` bytes)."""

    def __init__(self, size: int) -> None:
        self._memory = shared_memory.SharedMemory(create=True, size=size)
        self.name = self._memory.name
        self.size = size
        self._lock = threading.Lock()
        self._regions: deque[list] = deque()  # [offset, length, freed], oldest first
        self._head = 0  # where the next region starts

    def put(self, data: bytes | memoryview) -> Ticket | None:
        """Copy ``data`` in; None when no contiguous room is free right now."""
        n = len(data)
        if n == 0 or n > self.size:
            return None
        with self._lock:
            offset = self._place(n)
            if offset is None:
                return None
            self._regions.append([offset, n, False])
            self._head = offset + n
        self._memory.buf[offset : offset + n] = data
        return Ticket(self.name, offset, n)

    def _place(self, n: int) -> int | None:
        if not self._regions:
            self._head = 0
            return 0
        tail = self._regions[0][0]  # the oldest region still held
        if self._head >= tail:  # free: [head, size) and [0, tail)
            if self.size - self._head >= n:
                return self._head
            return 0 if tail >= n else None
        return self._head if tail - self._head >= n else None  # free: [head, tail)

    def free(self, ticket: Ticket) -> None:
        """The payload was read: its region may be reused (once the regions before it are free too)."""
        with self._lock:
            for region in self._regions:
                if region[0] == ticket.offset and region[1] == ticket.length and not region[2]:
                    region[2] = True
                    break
            while self._regions and self._regions[0][2]:
                self._regions.popleft()

    @property
    def held(self) -> int:
        """Bytes in regions not yet freed."""
        with self._lock:
            return sum(length for _, length, freed in self._regions if not freed)

    def close(self) -> None:
        self._memory.close()
        self._memory.unlink()


_REGISTER_LOCK = threading.Lock()


def _attach(name: str) -> shared_memory.SharedMemory:
    """Map the writer's arena without telling the resource tracker: the writer created it and
    unlinks it. (Python < 3.13 registers every attach; unregistering afterwards is no cure where the
    processes share one tracker, as a supervisor's spawned children do: it would drop the writer's
    own registration, and the writer's unlink would then find none.)"""
    with _REGISTER_LOCK:
        register = resource_tracker.register
        resource_tracker.register = lambda *args, **kwargs: None
        try:
            return shared_memory.SharedMemory(name=name)
        finally:
            resource_tracker.register = register


class Reader:
    """The reading side: arenas opened by name, once, and read in place."""

    def __init__(self) -> None:
        self._open: dict[str, shared_memory.SharedMemory] = {}
        self._lock = threading.Lock()

    def view(self, ticket: Ticket) -> memoryview:
        """The payload's bytes, in place: valid until the writer frees the ticket."""
        return self.view_at(ticket.arena, ticket.offset, ticket.length)

    def view_at(self, arena: str, offset: int, length: int) -> memoryview:
        memory = self._open.get(arena)
        if memory is None:
            with self._lock:
                memory = self._open.get(arena)
                if memory is None:
                    memory = self._open[arena] = _attach(arena)
        return memory.buf[offset : offset + length]

    def read(self, ticket: Ticket) -> bytes:
        return bytes(self.view(ticket))

    def close(self) -> None:
        with self._lock:
            for memory in self._open.values():
                memory.close()
            self._open.clear()
