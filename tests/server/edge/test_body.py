"""The guard's body wrapper alone (server/edge/body.py): a body within its deadline passes, one past
it is answered 408, one past its cap 413 as soon as the cap is passed."""

from __future__ import annotations

import asyncio
import json

from memvit.server.edge.guard import GuardMiddleware
from memvit.server.settings import Settings
from tests.server.http.test_timeouts import _ok_app


def _run_middleware(
    chunks: list[tuple[float, bytes]], seconds: float, **settings: int
) -> tuple[list[dict], list[dict]]:
    """``chunks``: (delay, bytes) the client sends to POST /classify through the guard (``seconds``: its
    body deadline; ``settings``: more of them). Returns what the app received and what was sent."""
    received: list[dict] = []
    sent: list[dict] = []

    async def app(scope, receive, send) -> None:
        while True:
            message = await receive()
            received.append(message)
            if message["type"] == "http.disconnect" or not message.get("more_body"):
                break
        await _ok_app(scope, receive, send)

    async def main() -> None:
        queue = iter(chunks)

        async def receive() -> dict:
            delay, data = next(queue)
            await asyncio.sleep(delay)
            return {"type": "http.request", "body": data, "more_body": data != b""}

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/classify", "headers": [(b"host", b"127.0.0.1")]}
        config = Settings(_env_file=None, body_timeout_seconds=seconds, **settings)
        await GuardMiddleware(app, config)(scope, receive, send)

    asyncio.run(main())
    return received, sent


def test_body_middleware_passes_a_body_within_the_deadline() -> None:
    received, sent = _run_middleware([(0.05, b"a"), (0.05, b"b"), (0.05, b"")], seconds=0.5)
    assert [m["body"] for m in received] == [b"a", b"b", b""]
    assert sent[0]["status"] == 200


def test_body_middleware_answers_408_at_the_deadline() -> None:
    received, sent = _run_middleware([(0.1, b"a")] * 10, seconds=0.35)
    assert received[-1] == {"type": "http.disconnect"} and len(received) == 4
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]  # app's 200 dropped
    assert sent[0]["status"] == 408 and (b"connection", b"close") in sent[0]["headers"]
    assert json.loads(sent[1]["body"])["error"]["type"] == "RequestTimeoutError"


def test_body_wrapper_answers_413_as_soon_as_the_cap_is_passed() -> None:
    """The same wrapper counts the bytes: one image of 1 byte caps /classify at 1 + 64 KiB."""
    chunk = bytes(40_000)
    received, sent = _run_middleware(
        [(0.01, chunk)] * 3, seconds=5, max_images_per_request=1, max_image_bytes=1
    )
    assert [m["type"] for m in received] == ["http.request", "http.disconnect"]
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]  # app's 200 dropped
    assert sent[0]["status"] == 413 and (b"connection", b"close") in sent[0]["headers"]
    error = json.loads(sent[1]["body"])["error"]
    assert (
        error["type"] == "RequestTooLargeError" and "at most 1 images of at most 1 bytes" in error["message"]
    )
