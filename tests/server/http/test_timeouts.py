"""The header deadline (server/http/timeouts.py) on both of uvicorn's HTTP parsers, serving a trivial
app: a client that trickles its headers is cut off; a protocol class it does not know fails at start;
a refusal sent while the client is still uploading reaches it (the lingering close,
server/edge/transport.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import uvicorn

from memvit.server.edge.transport import CoalescedWrites
from memvit.server.http.timeouts import header_timeout_protocol
from tests.server.conftest import free_port
from tests.server.test_slow_clients import SLACK, _read_response, _trickle


async def _ok_app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def _refusing_app(scope, receive, send) -> None:
    """413 at once, the body unread (as the guard refuses a body over its cap)."""
    if scope["type"] != "http":
        return
    headers = [(b"content-length", b"8"), (b"connection", b"close")]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": b"too much"})


@contextmanager
def _serve(http: str, seconds: float, app=_ok_app) -> Iterator[int]:
    port = free_port()
    config = uvicorn.Config(
        app, port=port, lifespan="off", log_level="warning", http=header_timeout_protocol(seconds, http)
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
        (t_seconds, t_answer, _), (s_seconds, s_answer, _), statuses = asyncio.run(main(port))
    assert seconds - 0.05 <= t_seconds <= seconds + SLACK and t_answer.startswith(b"HTTP/1.1 408 ")
    assert seconds - 0.05 <= s_seconds <= seconds + SLACK and s_answer == b""
    assert statuses == [200, 200, 200]


async def _upload_refused(port: int, size: int) -> bytes:
    """POSTs ``size`` bytes in one go and reads to the end: what the server sent, or the error."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n\r\n" % size)
    writer.write(b"x" * size)
    try:
        await asyncio.wait_for(writer.drain(), 10)
        return await asyncio.wait_for(reader.read(), 10)
    except ConnectionError as e:
        return repr(e).encode()
    finally:
        writer.close()


@pytest.mark.parametrize("lingering", [True, False], ids=["lingering", "plain close (control)"])
@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_a_refusal_reaches_a_client_still_uploading(http: str, lingering: bool, monkeypatch) -> None:
    """The server answers 413 with 32 MB still coming. Closed at once, the socket has unread bytes, so
    the kernel resets the connection and the client never reads its answer (the control shows the
    test can tell); closed lingering, the client reads the 413 whole, then the end."""
    if not lingering:
        monkeypatch.setattr(CoalescedWrites, "close_lingering", lambda self: self._transport.close())
    with _serve(http, 5.0, _refusing_app) as port:
        answer = asyncio.run(_upload_refused(port, 32_000_000))
    if lingering:
        assert answer.startswith(b"HTTP/1.1 413 ") and answer.endswith(b"\r\n\r\ntoo much"), answer[:200]
    else:
        assert b"413" not in answer, answer[:200]


def test_unknown_protocol_class_fails_at_start() -> None:
    with pytest.raises(RuntimeError, match="not supported"):
        header_timeout_protocol(1.0, "asyncio:Protocol")
