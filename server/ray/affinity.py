"""Which adapter a request is for, read in Ray's HTTP proxy, so Serve can send it to the replica
that holds that adapter (the router: server/ray/router.py).

The key comes from what the request already says; a client needs to know nothing of Ray:

- ``/classify?tasks=a,b`` (or ``?tasks=a&tasks=b``): the first adapter named (``base`` is not an
  adapter). A request naming several adapters goes where its first one is resident; the others are
  loaded there if they are not. A client that mixes a common adapter with a rare one gets the most
  from naming the rare one first.
- ``/v2/models/{adapter}/infer`` (the Open Inference Protocol, model name = adapter): the model's
  name, unless it is ``base`` (the fused model: its outputs, in the body, name the tasks).
- anything else (base-only, no filter, management, metrics): no key; Serve's default placement.
- ``serve_multiplexed_model_id`` (Ray's own header, ``-`` or ``_``), when the client sends it: used
  as is, an override. Blank: no key.

The key travels as that header, which Ray's proxy reads into the request's metadata for the router.
A malformed name is no key (the replica answers the request's 4xx as usual): routing never changes
what a request may do, only where it runs. This module runs in every proxy: no torch, no ray.
"""

from __future__ import annotations

import logging
import re
from urllib.parse import parse_qsl

from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger("memvit.ray.affinity")

KEY_HEADER = b"serve_multiplexed_model_id"  # Ray's name; it also reads serve-multiplexed-model-id
BASE_TASK = "base"
# memory_core.NAME_PATTERN, copied rather than imported: importing memory_core loads torch, and this
# runs in Ray's proxy (a test holds the two equal).
NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
# Matched at the end of the path: in the proxy, an application's route prefix is still part of it.
_CLASSIFY = re.compile(r"(?:^|/)classify$")
_OIP_INFER = re.compile(r"/v2/models/(?P<model>[^/]+)(?:/versions/[^/]+)?/infer$")


def _adapter(name: str) -> str | None:
    name = name.strip()
    return name if name != BASE_TASK and NAME_PATTERN.fullmatch(name) else None


def key_from_request(path: str, query_string: bytes) -> str | None:
    """The adapter a request is routed by, from its path and query string."""
    if _CLASSIFY.search(path):
        for field, value in parse_qsl(query_string.decode("latin-1")):
            if field != "tasks":
                continue
            for name in value.split(","):
                if name.strip() and name.strip() != BASE_TASK:
                    return _adapter(name)  # the first adapter named
        return None
    match = _OIP_INFER.search(path)
    return _adapter(match["model"]) if match else None


def _explicit(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    for name, value in headers:
        if name.lower().replace(b"-", b"_") == KEY_HEADER:
            return value
    return None


class AdapterAffinityMiddleware:
    """Adds the routing key to a request that does not carry one (HTTP only; nothing else changes)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = list(scope.get("headers", []))
            if _explicit(headers) is None:
                key = key_from_request(scope["path"], scope.get("query_string", b""))
                if key is not None:
                    scope = {**scope, "headers": [*headers, (KEY_HEADER, key.encode())]}
        await self.app(scope, receive, send)
