"""A connection's writes within one turn of the event loop, sent as one.

uvicorn writes a response's status line and headers, then its body, as two ``transport.write``
calls: two ``send`` system calls, two TCP segments and two wake-ups of the client for every JSON
answer. ``CoalescedWrites`` stands in for the transport: what is written during one turn of the
event loop goes out in one write at the end of it (or at once when the connection closes), so an
answer the app sends whole (start and body in one go, as every route here does) is one segment.
The order of the bytes and of the close are kept; a streamed answer still streams (each turn's
chunk goes out with the turn).
"""

from __future__ import annotations

import asyncio
from typing import Any


class CoalescedWrites:
    """A transport whose ``write`` is deferred to the end of the event loop's turn (see the module's doc);
    everything else is the wrapped transport's."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport, self._loop = transport, loop
        self._pending: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(bytes(data))

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if pending and not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def abort(self) -> None:
        self._pending = []
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        return sum(map(len, self._pending)) + self._transport.get_write_buffer_size()

    def __getattr__(self, name: str) -> Any:  # is_closing, get_extra_info, pause_reading, ...
        return getattr(self._transport, name)
