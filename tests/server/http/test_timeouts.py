"""The header deadline (server/http/timeouts.py) on both of uvicorn's HTTP parsers, serving a trivial
app: a client that trickles its headers is cut off; a protocol class it does not know fails at start."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import uvicorn

from memvit.server.http.timeouts import header_timeout_protocol
from tests.server.conftest import free_port
from tests.server.test_slow_clients import SLACK, _read_response, _trickle


async def _ok_app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@contextmanager
def _serve(http: str, seconds: float) -> Iterator[int]:
    port = free_port()
    config = uvicorn.Config(
        _ok_app, port=port, lifespan="off", log_level="warning", http=header_timeout_protocol(seconds, http)
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_header_deadline_on_both_parsers(http: str) -> None:
    """A trickler gets a 408 and a close at the deadline, a silent connection a close; a kept-alive
    connection idle past the deadline between requests, then slow within it, keeps answering."""
    # The kept-alive client sends its headers over 0.2 s: a deadline 5x that leaves room for a busy
    # machine (the first request's deadline runs from the connect).
    seconds = 1.0
    request = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"

    async def kept_alive(port: int) -> list[int]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        statuses = []
        for n in range(3):
            # Idle between requests past the deadline: that is uvicorn's keep-alive's (5 s) business.
            await asyncio.sleep(1.2 if n else 0)
            for i in range(0, len(request), 10):  # 0.2 s to send the headers: within the deadline
                writer.write(request[i : i + 10])
                await asyncio.sleep(0.1)
            statuses.append((await _read_response(reader))[0])
        writer.close()
        return statuses

    async def main(port: int):
        return await asyncio.gather(
            _trickle(port, b"GET / HTTP/1.1\r\n", b"X-Slow: 1\r\n", 3),
            _trickle(port, b"", b"", 3),
            kept_alive(port),
        )

    with _serve(http, seconds) as port:
        (t_seconds, t_answer), (s_seconds, s_answer), statuses = asyncio.run(main(port))
    assert seconds - 0.05 <= t_seconds <= seconds + SLACK and t_answer.startswith(b"HTTP/1.1 408 ")
    assert seconds - 0.05 <= s_seconds <= seconds + SLACK and s_answer == b""
    assert statuses == [200, 200, 200]


def test_unknown_protocol_class_fails_at_start() -> None:
    with pytest.raises(RuntimeError, match="not supported"):
        header_timeout_protocol(1.0, "asyncio:Protocol")
