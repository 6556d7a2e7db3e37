"""Deadlines for slow clients: one for a request's headers, one for its body.

uvicorn bounds the idle time between requests (``timeout_keep_alive``) but neither how long a client
may take to send a request's headers nor its body, so a client that trickles bytes (slowloris) holds
a connection, and for bodies a request task, forever.

- ``header_timeout_protocol(seconds)``: uvicorn's own HTTP protocol class (httptools or h11) with a
  timer armed when a connection opens or the first byte of a kept-alive connection's next request
  arrives, disarmed when the headers are complete. When it fires the connection is closed (after a
  408 if part of a request had arrived). Pass it as ``uvicorn.run(http=...)``.
- ``BodyTimeoutMiddleware``: a total deadline for reading a request's body (a per-chunk idle timeout
  would be defeated by trickling one byte at a time); past it the client gets a 408 and the
  connection is closed.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.config import HTTP_PROTOCOLS
from uvicorn.importer import import_from_string

from .errors import RequestTimeoutError, error_body

log = logging.getLogger("memvit.server.timeouts")


def _timeout_body(message: str) -> bytes:
    return json.dumps(error_body(RequestTimeoutError(message), RequestTimeoutError.status)).encode()


_HEADER_TIMEOUT_BODY = _timeout_body("the request headers did not arrive in time")
_BODY_TIMEOUT_BODY = _timeout_body("the request body did not arrive in time")
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
        if self._header_bytes:
            self.transport.write(_HEADER_TIMEOUT_RESPONSE)
        self.transport.close()

    def _peer(self) -> str:
        peer = self.transport.get_extra_info("peername")
        return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "a client"

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        # Covers a client that connects and then says nothing or trickles: uvicorn's keep-alive
        # timer only starts after a first response.
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
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
            "supported by server/timeouts.py"
        )
    return type(f"HeaderTimeout{name}", (mixin, base), {"header_timeout": float(seconds)})


class BodyTimeoutMiddleware:
    """A total deadline, from the start of the request, for reading its body.

    On expiry the client gets a 408 (if no response has started) with ``connection: close``, and the
    app sees ``http.disconnect``, as if the client had left; what the app sends after that is dropped.
    """

    def __init__(self, app: ASGIApp, seconds: float) -> None:
        if seconds <= 0:
            raise ValueError(f"body timeout must be positive, got {seconds}")
        self.app = app
        self.seconds = seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.seconds
        body_done = False
        response_started = False
        answered = False  # the 408 went out: what the app sends is dropped
        timed_out = False

        async def receive_by_deadline() -> Message:
            nonlocal body_done, timed_out, answered
            if body_done or timed_out:
                # After the body, receive() only waits for a disconnect: no deadline.
                return await receive() if body_done else {"type": "http.disconnect"}
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except asyncio.TimeoutError:
                timed_out = True
                log.debug(
                    "request body of %s %s not read within %ss", scope["method"], scope["path"], self.seconds
                )
                if not response_started:
                    answered = True
                    await _send_408(send)
                return {"type": "http.disconnect"}
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        async def send_unless_timed_out(message: Message) -> None:
            nonlocal response_started
            if answered:
                return
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        await self.app(scope, receive_by_deadline, send_unless_timed_out)


async def _send_408(send: Send) -> None:
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(_BODY_TIMEOUT_BODY)).encode()),
        # uvicorn closes the connection after this response, which stops reading the rest of the body.
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": 408, "headers": headers})
    await send({"type": "http.response.body", "body": _BODY_TIMEOUT_BODY, "more_body": False})
