"""The proxy middleware on its own (no Ray): what it changes and what it leaves alone.

The real thing, Ray's proxy losing a replica mid-request, is in test_ray_serve.py; these pin the
rules on ASGI apps that behave as Ray's proxy does (answering nothing; a 503 without Retry-After).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from memvit.server.ray.affinity import AdapterAffinityMiddleware
from memvit.server.ray.proxy import ReplicaLossMiddleware, proxy_middlewares


async def _silent(scope: Scope, receive: Receive, send: Send) -> None:
    """Ray's proxy when the replica died: it sends no response at all."""


async def _crashing(scope: Scope, receive: Receive, send: Send) -> None:
    raise RuntimeError("the proxy failed before answering")


def _answering(status: int, headers: list[tuple[bytes, bytes]], body: bytes = b"{}"):
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


def _get(app) -> httpx.Response:
    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=ReplicaLossMiddleware(app))
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            return await client.post("/classify", content=b"x")

    return asyncio.run(run())


@pytest.mark.parametrize("app", [_silent, _crashing], ids=["no-response", "error-before-response"])
def test_a_request_left_unanswered_is_a_503_with_retry_after(app) -> None:
    r = _get(app)
    assert r.status_code == 503
    assert r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "ReplicaUnavailableError"


def test_rays_own_503_gets_retry_after_and_keeps_its_body() -> None:
    r = _get(_answering(503, [(b"content-type", b"text/plain")], b"No replicas are available yet."))
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.text == "No replicas are available yet."


@pytest.mark.parametrize(
    "status,headers",
    [
        (200, [(b"content-type", b"application/json")]),
        (500, [(b"content-type", b"application/json")]),  # the app's own 500: not the proxy's to change
        (503, [(b"retry-after", b"7")]),
    ],
)
def test_answers_the_app_started_pass_unchanged(status, headers) -> None:
    r = _get(_answering(status, headers, b'{"ok": true}'))
    assert r.status_code == status and r.json() == {"ok": True}
    assert r.headers.get("retry-after") == ("7" if status == 503 else None)


def test_the_callback_names_the_middlewares() -> None:
    loss, affinity = proxy_middlewares()
    assert loss.cls is ReplicaLossMiddleware and affinity.cls is AdapterAffinityMiddleware
