"""The supervisor's stand-in (server/frontend/standin.py): it answers the port as a loading process
does while nothing else listens there, gives the port up once a process listens, and passes on the
connections it holds then, so that none is answered "not ready" while a process is ready."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from memvit.server.frontend.standin import StandIn, answer
from tests.server.conftest import free_port


class Process:
    """A process of the group, as the port sees it: listens with SO_REUSEPORT, answers 200 "ready"."""

    def __init__(self, port: int) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        self.sock.bind(("127.0.0.1", port))
        self.listening = threading.Event()

    def listen(self) -> None:
        self.sock.listen(64)
        self.listening.set()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data and (chunk := conn.recv(4096)):
                    data += chunk
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nconnection: close\r\n\r\nready")

    def close(self) -> None:
        self.listening.clear()
        self.sock.close()


@pytest.fixture
def port() -> Iterator[int]:
    reserved = socket.socket()  # as the supervisor holds the port: bound, not listening
    reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    reserved.bind(("127.0.0.1", free_port()))
    yield reserved.getsockname()[1]
    reserved.close()


def test_while_nothing_listens_it_answers_as_a_loading_process(port) -> None:
    standin = StandIn("127.0.0.1", port, lambda: False)
    standin.start()
    try:
        url = f"http://127.0.0.1:{port}"
        time.sleep(0.1)
        health = httpx.get(f"{url}/healthz")
        assert (health.status_code, health.json()) == (200, {"status": "alive", "detail": None})
        assert httpx.get(f"{url}/v2/health/live").status_code == 200
        ready = httpx.get(f"{url}/readyz")
        assert ready.status_code == 503 and ready.headers["retry-after"] == "1"
        assert ready.json()["status"] == "loading"
        other = httpx.post(f"{url}/classify", files={"image": ("a.jpg", b"x")})
        assert other.status_code == 503 and other.json()["error"]["type"] == "NotReadyError"
        assert other.headers["connection"] == "close"
        protocol = httpx.get(f"{url}/v2/health/ready")
        assert protocol.status_code == 503 and isinstance(protocol.json()["error"], str)
    finally:
        standin.close()


def test_the_answers_are_a_loading_apps(tiny_weights, tmp_path) -> None:
    """The same statuses and bodies as the app gives before its service is loaded."""
    import asyncio

    from memvit.server.http.app import create_app
    from memvit.server.settings import Settings

    async def never(state) -> None:
        await asyncio.Event().wait()

    settings = Settings(weights=tiny_weights, adapter_store=tmp_path / "s", admin_token="t")
    app = create_app(settings, start=never)

    async def ask(method: str, path: str) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            return await client.request(method, path, headers={"Authorization": "Bearer t"})

    for method, path in [("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/v2/health/live"),
                         ("GET", "/v2/health/ready"), ("GET", "/adapters")]:  # fmt: skip
        expected = asyncio.run(ask(method, path))
        head, _, body = answer(method, path).partition(b"\r\n\r\n")
        assert int(head[9:12]) == expected.status_code and body == expected.content, path
        assert (b"retry-after: 1" in head) == ("retry-after" in expected.headers), path


def test_once_a_process_listens_it_gives_the_port_up_and_passes_on_what_it_holds(port) -> None:
    process = Process(port)
    standin = StandIn("127.0.0.1", port, process.listening.is_set)
    standin.start()
    url = f"http://127.0.0.1:{port}"
    try:
        time.sleep(0.1)
        assert httpx.get(f"{url}/readyz").status_code == 503
        # Connections the stand-in accepted, their requests not yet complete when the process listens.
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(8)]
        time.sleep(0.1)
        process.listen()
        for conn in held:
            conn.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
        for conn in held:
            assert b"".join(iter(lambda c=conn: c.recv(4096), b"")).endswith(b"ready")
            conn.close()
        standin.update()  # as the supervisor does when it sees the process listening
        time.sleep(0.1)
        assert not standin.listening
        assert {httpx.get(f"{url}/readyz").text for _ in range(20)} == {"ready"}  # all to the process
        process.close()  # it died: the stand-in answers again once told
        standin.update()
        time.sleep(0.1)
        assert standin.listening and httpx.get(f"{url}/healthz").status_code == 200
    finally:
        standin.close()
        process.close()
