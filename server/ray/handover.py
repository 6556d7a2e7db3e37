"""A request Ray Serve hands to this replica after the replica holding it died may have lost its body.

Ray Serve's proxy forwards a request's body to its replica once, through a per-request queue the
replica drains by calling back into the proxy (Ray 2.60: ``receive_asgi_messages`` in
``ray/serve/_private/proxy.py``). When the replica that drained it dies before answering and the
proxy's router retries the request on another replica (it does when the death shows up as the
request is being placed), the new replica finds the queue empty and waits for a body that will not
come, until the client gives up: a hang of the client's whole timeout, seen here as a 20 s read
timeout for about one kill in five under load (tests/server/ray/test_serve.py).

Normally a request's first body message is already in the proxy's queue when the replica asks for
it, so ``HandOverMiddleware`` gives it ``FIRST_BODY_TIMEOUT_S`` to arrive: past that, the request is
answered 503 + Retry-After (its body was lost between replicas; sending it again works) and the app
sees ``http.disconnect``; what the app sends after that is dropped. Only the wait for the first
message is bounded: a body that began and then pauses (a slow upload) is the body deadline's
business (server/edge/body.py), and requests without a body are never touched.

It runs in the replica, in front of the app (server/ray/serve.py), and imports neither ray nor torch.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..edge.send import send_error

log = logging.getLogger("memvit.ray.handover")
FIRST_BODY_TIMEOUT_S = 2.0
RETRY_AFTER_SECONDS = "1"


class RequestBodyLostError(Exception):
    """The request's body never reached this replica. Not a ``ServiceError``: that would import the model."""

    expected = True  # a condition to retry, not a bug: its message is shown


def has_body(scope: Scope) -> bool:
    """Whether the request says it carries a body (a Content-Length above 0, or chunked)."""
    headers = Headers(scope=scope)
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return True
    try:
        return int(headers.get("content-length", "0")) > 0
    except ValueError:
        return False


class HandOverMiddleware:
    """503 + Retry-After for a request whose first body message does not arrive in time."""

    def __init__(self, app: ASGIApp, first_body_timeout_s: float = FIRST_BODY_TIMEOUT_S) -> None:
        self.app = app
        self.timeout_s = first_body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not has_body(scope):
            await self.app(scope, receive, send)
            return
        waiting, lost, started = True, False, False

        async def receive_first_in_time() -> Message:
            nonlocal waiting, lost
            if not waiting:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.timeout_s)
            except TimeoutError:
                lost = True
                return {"type": "http.disconnect"}
            waiting = False
            return message

        async def send_unless_lost(message: Message) -> None:
            nonlocal started
            if lost:
                return  # the 503 below answers instead
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive_first_in_time, send_unless_lost)
        except Exception:
            if not lost or started:
                raise
        if lost and not started:
            log.warning(
                "no body for %s within %gs (lost in a hand-over); answering 503",
                scope["path"],
                self.timeout_s,
            )
            error = RequestBodyLostError(
                "the request's body did not reach the replica (the one that had it stopped); send it again"
            )
            await send_error(send, 503, error, {"retry-after": RETRY_AFTER_SECONDS})
