"""The deadline for a request's headers, for slow clients.

uvicorn bounds the idle time between requests (``timeout_keep_alive``) but neither how long a client
may take to send a request's headers nor its body, so a client that trickles bytes (slowloris) holds
a connection, and for bodies a request task, forever. The body's deadline is the guard's (per route,
server/edge/body.py); the headers' is here, because it runs before there is any request to route:

``header_timeout_protocol(seconds)``: uvicorn's own HTTP protocol class (httptools or h11) with a
timer armed when a connection opens or the first byte of a kept-alive connection's next request
arrives, disarmed when the headers are complete. When it fires the connection is closed (after a 408
if part of a request had arrived). Pass it as ``uvicorn.run(http=...)``. Its connections also write
each response in one piece and close by lingering where the client is still sending
(server/edge/transport.py).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from typing import Any

from uvicorn.config import HTTP_PROTOCOLS
from uvicorn.importer import import_from_string

from ..edge.send import error_bytes
from ..edge.transport import CoalescedWrites
from ..errors import RequestTimeoutError

log = logging.getLogger("memvit.server.timeouts")

# Written on the transport before any ASGI app exists, in the same shape as every other error.
_HEADER_TIMEOUT_BODY = error_bytes(
    RequestTimeoutError("the request headers did not arrive in time"), RequestTimeoutError.status
)
_HEADER_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(_HEADER_TIMEOUT_BODY), _HEADER_TIMEOUT_BODY)
)


class _HeaderTimeoutMixin:
    """Mixed in before uvicorn's protocol class. Relies on its ``transport``, ``loop`` and ``cycle``
    (the current request: ``None`` or ``response_complete`` when no request is in flight), checked
    by ``header_timeout_protocol`` at start."""

    header_timeout: float = 10.0
    _header_timer: asyncio.TimerHandle | None = None
    _header_bytes = False  # part of a request arrived since the timer was armed

    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    cycle: Any

    def _idle(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_bytes = False
            self._header_timer = self.loop.call_later(self.header_timeout, self._header_timeout_expired)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout_expired(self) -> None:
        self._header_timer = None
        # A request that is running is bounded by the body deadline and the app, not by this timer.
        if self.transport.is_closing() or not self._idle():
            return
        log.debug("closing %s: no complete request headers within %ss", self._peer(), self.header_timeout)
        if self._header_bytes:  # the client is still sending: it must read the 408 before a reset
            self.transport.write(_HEADER_TIMEOUT_RESPONSE)
            self.transport.close_lingering()  # type: ignore[attr-defined]
        else:
            self.transport.close()

    def _peer(self) -> str:
        peer = self.transport.get_extra_info("peername")
        return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "a client"

    def connection_made(self, transport: asyncio.Transport) -> None:
        # Not about deadlines, but this class is where memvit meets uvicorn's connections: a
        # response's head and body leave in one write (server/edge/transport.py).
        loop = getattr(self, "loop", None) or asyncio.get_running_loop()
        super().connection_made(CoalescedWrites(transport, loop, self._body_unread))  # type: ignore[misc]
        # Covers a client that connects and then says nothing or trickles: uvicorn's keep-alive
        # timer only starts after a first response.
        self._arm_header_timer()

    def _body_unread(self) -> bool:
        # A refusal (413 on size, 408 on the body's deadline) answers before the body is all in.
        return self.cycle is not None and bool(getattr(self.cycle, "more_body", False))

    def data_received(self, data: bytes) -> None:
        if getattr(self.transport, "lingering", False):
            return  # a closed request's rest, drained so that the client reads its answer
        # The first byte of a kept-alive connection's next request starts its deadline (the idle time
        # before it is uvicorn's keep-alive timer's business). Bytes after a response that left the
        # body unread count too, so an ignored body cannot be trickled forever either.
        if self._idle():
            self._arm_header_timer()
            self._header_bytes = True
        super().data_received(data)  # type: ignore[misc]

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)  # type: ignore[misc]


class _HttpToolsHeaderTimeout(_HeaderTimeoutMixin):
    def on_headers_complete(self) -> None:
        self._disarm_header_timer()
        super().on_headers_complete()  # type: ignore[misc]


class _H11HeaderTimeout(_HeaderTimeoutMixin):
    def handle_events(self) -> None:
        # h11 reports complete headers as a Request event inside handle_events, which then starts a
        # new cycle; a new cycle object is the sign that headers completed.
        before = self.cycle
        super().handle_events()  # type: ignore[misc]
        if self.cycle is not before:
            self._disarm_header_timer()

    def handle_websocket_upgrade(self, event: Any) -> None:
        self._disarm_header_timer()
        super().handle_websocket_upgrade(event)  # type: ignore[misc]


# What each mixin needs of uvicorn's class: methods, and attributes its __init__ assigns.
_NEEDS = {
    "HttpToolsProtocol": (_HttpToolsHeaderTimeout, ("on_headers_complete",)),
    "H11Protocol": (_H11HeaderTimeout, ("handle_events", "handle_websocket_upgrade")),
}
_COMMON_METHODS = ("connection_made", "connection_lost", "data_received")
_INSTANCE_ATTRIBUTES = ("transport", "loop", "cycle")


def header_timeout_protocol(seconds: float, http: str = "auto") -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class named by ``http`` ("auto", "httptools", "h11") with a deadline of
    ``seconds`` for each request's headers. Raises RuntimeError at once if uvicorn's class is not one
    this was written against, rather than failing on each connection."""
    if seconds <= 0:
        raise ValueError(f"header timeout must be positive, got {seconds}")
    base: type[asyncio.Protocol] = import_from_string(HTTP_PROTOCOLS.get(http, http))
    found = next(((name, need) for name, need in _NEEDS.items() if base.__name__ == name), None)
    if found is None:
        raise RuntimeError(
            f"header timeout: uvicorn's HTTP protocol {base.__module__}.{base.__name__} is not supported "
            f"(expected one of {sorted(_NEEDS)}); uvicorn changed?"
        )
    name, (mixin, methods) = found
    assigned = set(base.__init__.__code__.co_names)  # attribute names stored by __init__
    cycle = getattr(importlib.import_module(base.__module__), "RequestResponseCycle", None)
    missing = [m for m in (*_COMMON_METHODS, *methods) if not callable(getattr(base, m, None))]
    missing += [a for a in _INSTANCE_ATTRIBUTES if a not in assigned]
    if cycle is None or "response_complete" not in cycle.__init__.__code__.co_names:
        missing.append("RequestResponseCycle.response_complete")
    if missing:
        raise RuntimeError(
            f"header timeout: uvicorn's {name} lacks {', '.join(missing)}; this uvicorn version is not "
            "supported by server/http/timeouts.py"
        )
    return type(f"HeaderTimeout{name}", (mixin, base), {"header_timeout": float(seconds)})
