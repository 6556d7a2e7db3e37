"""503s say what happened (not ready / overloaded), carry Retry-After, and log one line each."""

from __future__ import annotations

import asyncio
import io
import logging

import httpx
from PIL import Image

from memvit.server.http.app import create_app
from memvit.server.settings import Settings
from tests.server.conftest import free_port, running_server


def test_not_ready_says_so(tiny_weights, tmp_path, caplog) -> None:
    app = create_app(Settings(weights=tiny_weights, adapter_store=tmp_path / "store", port=free_port()))

    async def ask() -> httpx.Response:
        # ASGITransport runs no lifespan: the model never loads, as in the first seconds of a start.
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://localhost"
        ) as http:
            return await http.get("/adapters")

    r = asyncio.run(ask())
    assert r.status_code == 503 and r.headers["Retry-After"] == "1"
    assert r.json()["error"]["type"] == "NotReadyError"
    assert "still loading" in r.json()["error"]["message"]
    assert not [rec for rec in caplog.records if rec.exc_info], "a 503 must not log a traceback"


def test_overloaded_says_so_with_one_line_per_refusal(tiny_weights, tmp_path, caplog) -> None:
    settings = Settings(
        weights=tiny_weights, adapter_store=tmp_path / "store", port=free_port(), max_queue=1, max_wait_ms=50
    )
    png = io.BytesIO()
    Image.new("RGB", (32, 32), "red").save(png, format="PNG")

    async def burst(url: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            files = {"image": ("x.png", png.getvalue())}
            return await asyncio.gather(*(http.post("/classify", files=files) for _ in range(24)))

    # In this process: caplog sees its log lines, whatever MEMVIT_TEST_API_PROCESSES says.
    with caplog.at_level(logging.WARNING), running_server(settings, create_app(settings)) as url:
        responses = asyncio.run(burst(url))
    refused = [r for r in responses if r.status_code == 503]
    assert refused and all(r.status_code in (200, 503) for r in responses)
    for r in refused:
        assert r.headers["Retry-After"] == "1"
        assert (
            r.json()["error"]["type"] == "OverloadedError" and "server busy" in r.json()["error"]["message"]
        )
    assert not [rec for rec in caplog.records if rec.exc_info], "a 503 must not log a traceback"
    lines = [rec for rec in caplog.records if "server busy" in rec.getMessage()]
    assert len(lines) == len(refused)
