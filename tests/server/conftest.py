"""Real servers for the HTTP tests: uvicorn on a free port (in a thread, or as a `memvit serve` process)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn

from adapters import AdapterBundle, bundle_for
from memory_core import MemoryViT
from server.app import create_app
from server.settings import Settings
from tests.conftest import REPO, SHARED_DATA, random_adapter

PHOTOS = SHARED_DATA / "photos"
TOKEN = "s3cret-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} not ready after {timeout}s")


@contextmanager
def running_server(settings: Settings, app=None) -> Iterator[str]:
    """uvicorn serving ``app`` (default ``create_app(settings)``) in a thread; yields the URL once ready."""
    app = app if app is not None else create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=settings.port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{settings.port}"
    try:
        wait_ready(url)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=20)


class ServerProcess:
    """``memvit serve`` as a child process, for restarts and SIGKILL."""

    def __init__(self, weights: Path | None, store: Path, **env: str) -> None:
        """``weights=None``: no model configured, so the server serves the embedded demo."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        inherited = {k: v for k, v in os.environ.items() if k not in ("MEMVIT_WEIGHTS", "MEMVIT_MODEL")}
        self.env = {
            **inherited,
            **({"MEMVIT_WEIGHTS": str(weights)} if weights is not None else {}),
            "MEMVIT_ADAPTER_STORE": str(store),
            "MEMVIT_PORT": str(self.port),
            "MEMVIT_STORE_POLL_SECONDS": "0.2",
            **env,
        }
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> ServerProcess:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "serve"],
            cwd=REPO,
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            wait_ready(self.url, timeout)
        except TimeoutError:
            self.kill()
            raise
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)


@pytest.fixture
def store(tmp_path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def settings(tiny_weights, store) -> Settings:
    return Settings(
        weights=tiny_weights,
        adapter_store=store,
        port=free_port(),
        admin_token=TOKEN,
        store_poll_seconds=0.2,
        max_wait_ms=2,
    )


@pytest.fixture
def server(settings) -> Iterator[str]:
    with running_server(settings) as url:
        yield url


@pytest.fixture
def client(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, timeout=30, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        yield c


@pytest.fixture(scope="session")
def tiny_engine_for_bundles(tiny_weights) -> MemoryViT:
    return MemoryViT.from_timm(weights=str(tiny_weights))


@pytest.fixture
def make_bundle(tiny_engine_for_bundles):
    def make(name: str, **kwargs) -> AdapterBundle:
        engine = tiny_engine_for_bundles
        return bundle_for(random_adapter(name, engine, **kwargs), engine)

    return make


def photo(name: str) -> bytes:
    path = PHOTOS / "formats" / name
    if not path.is_file():
        pytest.skip(f"{path} not found (../shared/data is absent)")
    return path.read_bytes()
