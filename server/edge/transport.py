"""A connection's writes within one turn of the event loop, sent as one.

uvicorn writes a response's status line and headers, then its body, as two ``transport.write``
calls: two ``send`` system calls, two TCP segments and two wake-ups of the client for every JSON
answer. ``CoalescedWrites`` stands in for the transport: what is written during one turn of the
event loop goes out in one write at the end of it (or at once when the connection closes), so an
answer the app sends whole (start and body in one go, as every route here does) is one segment.
The order of the bytes and of the close are kept; a streamed answer still streams (each turn's
chunk goes out with the turn).

It also closes by lingering where a close would lose the answer. A refusal sent before the request
is in (413 on a body's size, 408 on its deadline or its headers') is followed by a close while the
client may still be sending; a socket closed with unread bytes resets the connection, and the
client's kernel then drops the answer it has not read yet, so the client sees "connection reset"
instead of its 4xx. Lingering (as Apache's lingering_close and nginx's lingering_close do): send
the answer and a FIN (``write_eof``), read and discard what still arrives, and close when the
client closes or after ``LINGER_SECONDS``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

# How long a connection closed on an unread request keeps draining it: the client has the answer
# and a FIN once the bytes it had in flight arrive; a client that keeps sending past this is reset.
LINGER_SECONDS = 2.0


class CoalescedWrites:
    """A transport whose ``write`` is deferred to the end of the event loop's turn, and whose ``close``
    lingers while ``unread()`` says the request is not all in (see the module's doc); everything else
    is the wrapped transport's."""

    def __init__(
        self,
        transport: asyncio.Transport,
        loop: asyncio.AbstractEventLoop,
        unread: Callable[[], bool] | None = None,
    ) -> None:
        self._transport, self._loop = transport, loop
        self._pending: list[bytes] = []
        self._unread = unread
        self.lingering = False  # closed to the app: what still arrives is discarded

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
        if self._unread is not None and self._unread():
            self.close_lingering()
        elif not self.lingering:
            self._transport.close()

    def close_lingering(self) -> None:
        """Close once the client has the answer: a FIN after what was written, then what arrives is
        read and dropped until the client closes (the transport closes itself on EOF) or
        ``LINGER_SECONDS`` pass."""
        self._flush()
        transport = self._transport
        if self.lingering or transport.is_closing():
            return
        if not transport.can_write_eof():
            transport.close()
            return
        self.lingering = True
        transport.write_eof()
        transport.resume_reading()  # uvicorn may have paused it (its body buffer full): drain
        self._loop.call_later(LINGER_SECONDS, transport.close)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def abort(self) -> None:
        self._pending = []
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        return sum(map(len, self._pending)) + self._transport.get_write_buffer_size()

    def __getattr__(self, name: str) -> Any:  # get_extra_info, pause_reading, ...
        return getattr(self._transport, name)
