"""Slow clients cannot hold the server: header (server/http/timeouts.py) and body (server/edge/body.py)
deadlines.

Against a real ``memvit serve`` (1 s header, 2 s body deadline). Raw sockets, because HTTP clients
will not trickle. The header deadline on both of uvicorn's parsers is tests/server/http/test_timeouts.py,
the guard's body wrapper alone tests/server/edge/test_body.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest

from tests.server.conftest import ServerProcess
from tests.server.test_api import jpeg

HEADER_S, BODY_S = 1.0, 2.0
SLACK = 1.5  # how late past its deadline a connection may close, on a loaded 2-core machine
TRICKLE_EVERY = 0.25  # well under both deadlines: a per-chunk idle timeout would never fire
BOUNDARY = "slowboundary"
log = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def slow_server(tiny_weights, tmp_path_factory) -> Iterator[ServerProcess]:
    server = ServerProcess(
        tiny_weights,
        tmp_path_factory.mktemp("store"),
        MEMVIT_HEADER_TIMEOUT_SECONDS=str(HEADER_S),
        MEMVIT_BODY_TIMEOUT_SECONDS=str(BODY_S),
        MEMVIT_LOG_LEVEL="warning",  # its stderr is a pipe nobody reads
    ).start()
    try:
        yield server
    finally:
        server.stop()


PART_HEAD = (
    f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="image"; filename="a.jpg"\r\n'
    "Content-Type: image/jpeg\r\n\r\n"
).encode()


def _multipart(data: bytes) -> bytes:
    return PART_HEAD + data + f"\r\n--{BOUNDARY}--\r\n".encode()


def _classify_head(length: int) -> bytes:
    return (
        f"POST /classify?top_k=1 HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {length}\r\n"
        f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n\r\n"
    ).encode()


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One response with a Content-Length: its status and body."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:] if line)
    return int(lines[0].split()[1]), await reader.readexactly(int(headers["content-length"]))


class Trickled(NamedTuple):
    seconds: float  # from connecting to the server's close (inf: it held on past ``give_up``)
    answer: bytes  # what the server sent
    head_at: float  # seconds from connecting to the head's write (this loop may be late with it)


async def _trickle(port: int, head: bytes, drip: bytes, give_up: float) -> Trickled:
    """Sends ``head`` then ``drip`` every TRICKLE_EVERY until the server closes the connection."""
    loop = asyncio.get_running_loop()
    started = loop.time()  # before connecting: never later than the server's accept
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def read_to_close() -> tuple[float, bytes]:
        answer = b""
        try:
            while chunk := await reader.read(65536):
                answer += chunk
        except ConnectionError:
            pass
        return loop.time() - started, answer

    reading = asyncio.create_task(read_to_close())
    writer.write(head)
    head_at = loop.time() - started
    while not reading.done() and loop.time() - started < give_up:
        await asyncio.wait({reading}, timeout=TRICKLE_EVERY)
        if not reading.done() and drip:
            writer.write(drip)
    writer.close()
    if not reading.done():
        reading.cancel()
        return Trickled(float("inf"), b"", head_at)
    return Trickled(*reading.result(), head_at)


async def _normal_clients(client: httpx.AsyncClient, until: float) -> dict[str, list[float]]:
    """GET /healthz and POST /classify one after the other until ``until``; latency of each (all 200)."""
    image = jpeg()
    latencies: dict[str, list[float]] = {"healthz": [], "classify": []}
    while time.monotonic() < until:
        for name in latencies:
            t0 = time.perf_counter()
            if name == "healthz":
                r = await client.get("/healthz")
            else:
                r = await client.post("/classify", files={"image": ("a.jpg", image, "image/jpeg")})
            latencies[name].append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
    return latencies


def _sockets(pid: int) -> int:
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(FileNotFoundError):  # closed between the listing and the read: gone
            count += os.readlink(fd).startswith("socket:")
    return count


def test_tricklers_are_cut_off_and_normal_clients_keep_their_latency(slow_server) -> None:
    port, url, n = slow_server.port, slow_server.url, 200
    sockets_before = _sockets(slow_server.pid) if Path("/proc").is_dir() else None

    async def main():
        # One kept-alive connection, opened before the attack: a connection opened beside 400 others
        # from this same loop may send its headers after the server's 1 s deadline (seen in CI: the
        # server rightly closed it, as it closes a late trickler's), which says nothing of the server.
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            return await attacked(client)

    async def attacked(client: httpx.AsyncClient):
        baseline = await _normal_clients(client, time.monotonic() + 0.5)
        header_head = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n"  # never finished
        attack = [_trickle(port, header_head, b"X-Slow: 1\r\n", HEADER_S + 3) for _ in range(n)]
        # A well-formed upload whose image never ends: the form parser waits for it.
        body_head = _classify_head(100_000) + PART_HEAD
        attack += [_trickle(port, body_head, b"x", BODY_S + 3) for _ in range(n)]
        during = _normal_clients(client, time.monotonic() + BODY_S + 0.5)
        *results, latencies = await asyncio.gather(*attack, during)
        return baseline, results[:n], results[n:], latencies

    baseline, headers, bodies, latencies = asyncio.run(main())
    log.info(
        "median latency before/during: %s",
        {k: (statistics.median(baseline[k]), statistics.median(v)) for k, v in latencies.items()},
    )

    late = 0
    for (seconds, answer, head_at), deadline in [(r, HEADER_S) for r in headers] + [
        (r, BODY_S) for r in bodies
    ]:
        assert seconds <= deadline + SLACK, (deadline, seconds)
        if head_at > HEADER_S - 0.05:
            # With 400 connections opening at once this loop can write a head after the server's
            # header deadline has passed: the server then rightly closed a connection that had said
            # nothing, without a 408 (seen in a full CI run). Every head sent in time gets its 408.
            late += 1
            continue
        assert deadline - 0.05 <= seconds, (deadline, seconds)
        assert answer.startswith(b"HTTP/1.1 408 "), (answer[:200], deadline, seconds, head_at)
    # How many heads went out late says how loaded this machine was, not how the server behaved (a
    # full CI run saw all 400 connects take over a second): logged, not asserted.
    log.info("%d of %d heads written after the header deadline", late, 2 * n)
    refused = [r.answer for r in bodies if r.answer.startswith(b"HTTP/1.1 408 ")]
    for answer in refused[:1]:  # a body's 408 names the body
        error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["type"] == "RequestTimeoutError" and "body" in error["message"]
    for name, during in latencies.items():
        before = statistics.median(baseline[name])
        assert statistics.median(during) < 0.5, (name, before, sorted(during))
    assert httpx.get(f"{url}/readyz", timeout=5).status_code == 200
    if sockets_before is not None:  # the server let go of all 400
        assert _sockets(slow_server.pid) <= sockets_before + 5


def test_slow_but_in_time_request_succeeds(slow_server) -> None:
    """Headers over 0.6 s and a body over 1.2 s: past the header deadline in all, within each."""
    body = _multipart(jpeg())
    head = _classify_head(len(body))

    async def main():
        reader, writer = await asyncio.open_connection("127.0.0.1", slow_server.port)
        for i in range(0, len(head), len(head) // 4 + 1):
            writer.write(head[i : i + len(head) // 4 + 1])
            await asyncio.sleep(0.15)
        step = len(body) // 8 + 1
        for i in range(0, len(body), step):
            writer.write(body[i : i + step])
            await asyncio.sleep(0.15)
        status, answer = await _read_response(reader)
        writer.close()
        return status, json.loads(answer)

    status, answer = asyncio.run(main())
    assert status == 200, answer
    assert len(answer["results"]) == 1
