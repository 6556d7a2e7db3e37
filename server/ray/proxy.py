"""Ray Serve's HTTP proxy, made to answer a lost replica the way memvit answers being busy: 503.

When a replica dies while it holds a request (its actor is killed, its node is lost), Ray Serve's
proxy gets ``RayActorError`` for that request and sends no response at all (Ray 2.60:
``send_http_response_on_exception`` writes a body only for 408/429/503), so uvicorn answers a bare
``500 Internal Server Error`` in text/plain. Clients cannot tell that from a bug. This middleware
wraps the proxy: a request that ends with no response is answered ``503`` with ``Retry-After`` and
the service's JSON error body, and a 503 of Ray's own (no replica yet, back-pressure without a
configured ``retry_after_s``) gets the ``Retry-After`` it lacks. memvit's app answers every request
it receives itself (its errors included), so a missing response always means the replica was lost.

Ray loads it in every proxy from the environment of ``ray start`` (or of a local ``serve run``)::

    RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=memvit.server.ray.proxy:proxy_middlewares

This module runs in the proxy process: it must stay light (no torch, no model, no ray import); its
error body comes from server/edge/send.py, which is as light.
"""

from __future__ import annotations

import logging

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..edge.send import send_error
from .affinity import AdapterAffinityMiddleware

log = logging.getLogger("memvit.ray.proxy")
CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK = "memvit.server.ray.proxy:proxy_middlewares"
RETRY_AFTER_SECONDS = "1"


class ReplicaUnavailableError(Exception):
    """The replica holding a request was lost. Not a ``ServiceError``: that would import the model."""

    expected = True  # a condition to retry, not a bug: its message is shown, as for memvit's own 503s


class ReplicaLossMiddleware:
    """Turns "no response" (the replica died mid-request) into 503 + Retry-After; adds Retry-After to
    Ray's own 503s. Responses that the app started are passed through untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = disconnected = False

        async def watch_receive() -> Message:
            nonlocal disconnected
            message = await receive()
            disconnected = disconnected or message["type"] == "http.disconnect"
            return message

        async def send_with_retry_after(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if message["status"] == 503 and not any(
                    name.lower() == b"retry-after" for name, _ in message.get("headers", [])
                ):
                    headers = [*message.get("headers", []), (b"retry-after", RETRY_AFTER_SECONDS.encode())]
                    message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, watch_receive, send_with_retry_after)
        except Exception:
            if started:
                raise
            log.warning("proxy error before any response on %s; answering 503", scope.get("path"))
        if not started and not disconnected:  # a client that left needs no answer (Ray logs a 499)
            log.warning(
                "no response from the replica for %s (replica lost); answering 503", scope.get("path")
            )
            lost = ReplicaUnavailableError(
                "the replica serving this request was lost (restarting or moved); retry shortly"
            )
            await send_error(send, 503, lost, {"retry-after": RETRY_AFTER_SECONDS})


def proxy_middlewares() -> list[Middleware]:
    """What ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` names: the middlewares every proxy wraps
    (the second reads which adapter a request is for, for the router: server/ray/affinity.py)."""
    return [Middleware(ReplicaLossMiddleware), Middleware(AdapterAffinityMiddleware)]
