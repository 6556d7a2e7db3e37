"""The protocol's error shape, ``{"error": "<message>"}``, for every refusal under ``/v2``.

The service answers errors as ``{"error": {"type", "message", "field"?}}`` from several places (the
guard, the exception handlers, validation); clients of the Open Inference Protocol (tritonclient,
KServe's) read ``error`` as a string. Rather than teach each of those places about one prefix, this
middleware, outside the guard, rewrites the JSON error bodies of ``/v2`` responses to the protocol's
shape: the status and headers stay, the message stays, only the shape changes.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

PREFIX = "/v2"


class ProtocolErrorShape:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]
        if scope["type"] != "http" or not (path == PREFIX or path.startswith(PREFIX + "/")):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        chunks: list[bytes] = []

        async def reshape(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers", []))
                if message["status"] >= 400 and headers.get(b"content-type", b"").startswith(
                    b"application/json"
                ):
                    start = message  # hold it until the body is complete
                    return
                await send(message)
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = _protocol_body(b"".join(chunks))
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})

        await self.app(scope, receive, reshape)


def _protocol_body(body: bytes) -> bytes:
    try:
        doc = json.loads(body)
        error = doc["error"]
    except (ValueError, KeyError, TypeError):
        return body
    if isinstance(error, dict):
        message = error.get("message", "")
        field = error.get("field")
        return json.dumps({"error": f"{message} (field: {field})" if field else message}).encode()
    return body
