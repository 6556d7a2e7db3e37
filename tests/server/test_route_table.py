"""The guard's one table (server/edge/routes.py) and the guard in process: every route of the app has a
row, the rows say who may call and what changes state, and refusals have the one error shape."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
from fastapi import APIRouter

from memvit.server.edge.guard import GuardMiddleware
from memvit.server.edge.routes import Access, RouteTable, app_routes, missing_routes, route_table
from memvit.server.edge.send import error_body, send_error
from memvit.server.errors import RequestTimeoutError
from memvit.server.http import app as app_module
from memvit.server.http.app import create_app
from memvit.server.settings import Settings
from tests.server.conftest import TOKEN
from tests.server.launcher import REPO

MANAGEMENT = {("POST", "/adapters"), ("DELETE", "/adapters/{name}")}


@pytest.fixture
def settings(tmp_path) -> Settings:
    return Settings(_env_file=None, adapter_store=str(tmp_path / "store"), admin_token=TOKEN)


def test_every_route_of_the_app_has_a_row_and_every_row_a_route(settings) -> None:
    """A new route cannot skip the guard: it would have no row here (and create_app would refuse)."""
    table = route_table(settings)
    served = app_routes(create_app(settings))
    assert served == {(r.method, r.path) for r in table}
    assert {("POST", "/classify"), *MANAGEMENT, ("GET", "/openapi.json")} <= served


def test_only_management_is_admin_and_changes_state(settings) -> None:
    table = route_table(settings)
    assert {(r.method, r.path) for r in table if r.access is Access.ADMIN} == MANAGEMENT
    assert {(r.method, r.path) for r in table if r.changes_state} == MANAGEMENT
    capped = {(r.method, r.path): r.cap.limit for r in table if r.cap is not None}
    assert capped == {
        ("POST", "/adapters"): settings.max_bundle_bytes + 64 * 1024,
        ("POST", "/classify"): settings.max_images_per_request * settings.max_image_bytes + 64 * 1024,
        # The protocol's infer carries the same images as tensor data; its index request, no body.
        ("POST", "/v2/models/{model}/infer"): settings.max_images_per_request * settings.max_image_bytes
        + 64 * 1024,
        ("POST", "/v2/repository/index"): 64 * 1024,
    }
    assert {r.deadline for r in table} == {settings.body_timeout_seconds}


def test_lookup(settings) -> None:
    table = route_table(settings)
    assert table.find("DELETE", "/adapters/a.b-c").path == "/adapters/{name}"
    assert table.find("DELETE", "/adapters/a/b") is None  # no route matches it either
    assert table.find("DELETE", "/adapters") is None
    assert table.find("HEAD", "/healthz").path == "/healthz"
    assert table.find("GET", "/ui/samples").path == "/ui/samples"  # the literal, not /ui/{name}
    assert table.find("GET", "/ui/app.js").path == "/ui/{name}"
    fallback = table.fallback("POST", "/nope")
    assert (fallback.access, fallback.changes_state, fallback.cap) == (Access.PUBLIC, False, None)


def test_an_app_with_a_route_the_table_lacks_is_refused(settings, monkeypatch) -> None:
    app = create_app(settings)
    extra = APIRouter(prefix="/extra")
    extra.post("/{name}")(lambda name: None)
    app.include_router(extra)
    app.add_api_route("/more", lambda: None, methods=["GET"])
    assert missing_routes(app, route_table(settings)) == ["GET /more", "POST /extra/{name}"]

    def without_classify(settings: Settings) -> RouteTable:
        table = route_table(settings)
        rows = [r for r in table if r.path != "/classify"]
        return RouteTable(rows, table.default_deadline)

    monkeypatch.setattr(app_module, "route_table", without_classify)
    with pytest.raises(RuntimeError, match=r"routes missing from the route table.*POST /classify"):
        create_app(settings)


def _call(app, settings: Settings, **scope) -> tuple[dict, list[dict]]:
    """Runs one request with an empty body through the guard; the scope and what was sent. It names the
    server in its Host header, as every HTTP/1.1 client does."""
    scope = {"type": "http", "headers": [(b"host", b"127.0.0.1:8000")], **scope}
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(GuardMiddleware(app, settings)(scope, receive, send))
    return scope, sent


async def _must_not_run(scope, receive, send) -> None:
    raise AssertionError("the app ran for a request the guard refused")


def test_a_refusal_before_the_body_closes_and_is_counted_under_its_route(settings) -> None:
    scope, (start, body) = _call(
        _must_not_run, settings, method="DELETE", path="/api/adapters/x", root_path="/api"
    )
    assert start["status"] == 401
    assert (b"connection", b"close") in start["headers"] and (b"www-authenticate", b"Bearer") in start[
        "headers"
    ]
    assert json.loads(body["body"]) == {
        "error": {
            "type": "NotAuthenticatedError",
            "message": "this endpoint needs 'Authorization: Bearer <admin token>'",
        }
    }
    assert scope["route"].path == "/adapters/{name}"  # metrics' label, though the router never saw it


def test_an_unlisted_request_reaches_the_app(settings) -> None:
    async def not_found(scope, receive, send) -> None:
        assert await receive() == {"type": "http.request", "body": b"", "more_body": False}
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    scope, sent = _call(not_found, settings, method="POST", path="/adapters/x/y")
    assert sent[0]["status"] == 404 and "route" not in scope


def test_send_error_is_the_handlers_shape() -> None:
    """What the edge sends and what the FastAPI handlers answer come from one function."""
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    error = RequestTimeoutError("slow")
    error.field = "image"
    asyncio.run(send_error(send, 408, error, {"Connection": "close"}))
    start, body = sent
    assert start["headers"] == [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body["body"])).encode()),
        (b"connection", b"close"),
    ]
    assert json.loads(body["body"]) == {
        "error": {"type": "RequestTimeoutError", "message": "slow", "field": "image"}
    }
    assert error_body(RuntimeError("secret"), 500) == {
        "error": {"type": "RuntimeError", "message": "internal error"}
    }


def test_the_error_shape_loads_without_torch() -> None:
    """The Ray proxy imports it (and memvit.server.ray.proxy) in a process that must stay light."""
    code = "import sys, memvit.server.ray.proxy, memvit.server.edge.send; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0
