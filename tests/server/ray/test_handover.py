"""The replica's guard against a body lost in a Ray Serve hand-over (server/ray/handover.py): a request
whose body never starts gets 503 + Retry-After in the service's error shape, a body that starts and
then pauses is read whole, and requests without a body are not touched. Plain ASGI, no Ray."""

from __future__ import annotations

import asyncio
import json

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from memvit.server.ray.handover import HandOverMiddleware


async def _echo(request: Request) -> JSONResponse:
    try:
        body = await request.body()
    except ClientDisconnect:
        return JSONResponse({"app": "saw the disconnect"}, status_code=400)  # must not reach the client
    return JSONResponse({"bytes": len(body)})


async def _hello(request: Request) -> JSONResponse:
    return JSONResponse({"hello": True})


APP = Starlette(routes=[Route("/echo", _echo, methods=["POST"]), Route("/", _hello)])


def _call(method: str, headers: dict[str, str], chunks: list[tuple[float, bytes]] | None) -> list[dict]:
    """The middleware (0.1 s for the first body message) on one request; ``chunks``: (delay, bytes)
    pairs the client sends, the last one ending the body; None: the body never comes."""
    scope = {
        "type": "http",
        "method": method,
        "path": "/echo" if method == "POST" else "/",
        "raw_path": b"/",
        "query_string": b"",
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
    }
    pending = list(chunks or [])
    sent: list[dict] = []

    async def receive() -> dict:
        if chunks is None or not pending:
            await asyncio.Event().wait()  # nothing ever arrives
        delay, data = pending.pop(0)
        await asyncio.sleep(delay)
        return {"type": "http.request", "body": data, "more_body": bool(pending)}

    async def send(message: dict) -> None:
        sent.append(message)

    async def run() -> None:
        await asyncio.wait_for(HandOverMiddleware(APP, first_body_timeout_s=0.1)(scope, receive, send), 5)

    asyncio.run(run())
    return sent


def _response(sent: list[dict]) -> tuple[int, dict[str, str], dict]:
    starts = [m for m in sent if m["type"] == "http.response.start"]
    assert len(starts) == 1, sent
    headers = {k.decode(): v.decode() for k, v in starts[0]["headers"]}
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return starts[0]["status"], headers, json.loads(body)


def test_a_body_that_never_comes_is_answered_503_with_retry_after() -> None:
    status, headers, body = _response(_call("POST", {"content-length": "10"}, None))
    assert status == 503 and headers["retry-after"] == "1"
    assert body["error"]["type"] == "RequestBodyLostError" and "send it again" in body["error"]["message"]


def test_a_body_that_starts_and_then_pauses_is_read_whole() -> None:
    chunks = [(0.0, b"12345"), (0.3, b"67890")]  # the pause is three times the first-message bound
    status, _, body = _response(_call("POST", {"content-length": "10"}, chunks))
    assert (status, body) == (200, {"bytes": 10})


def test_a_chunked_body_counts_as_a_body() -> None:
    status, _, _ = _response(_call("POST", {"transfer-encoding": "chunked"}, None))
    assert status == 503


def test_requests_without_a_body_are_not_touched() -> None:
    status, _, body = _response(_call("GET", {}, None))
    assert (status, body) == (200, {"hello": True})
    status, _, body = _response(_call("POST", {"content-length": "0"}, [(0.3, b"")]))
    assert (status, body) == (200, {"bytes": 0})  # no bound on a body that says it is empty
