"""Fixtures for the HTTP tests: settings, a running server, clients, bundles, photos.

The servers themselves start in launcher.py (which benchmarks/serve.py uses too).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from memvit.adapters import AdapterBundle, bundle_for
from memvit.memory_core import MemoryViT
from memvit.server.settings import Settings
from tests.conftest import SHARED_DATA, random_adapter

# Re-exported: the tests import the launcher from here.
from tests.server.launcher import ServerProcess, free_port, running_server, wait_ready  # noqa: F401

PHOTOS = SHARED_DATA / "photos"
TOKEN = "s3cret-token"


@pytest.fixture
def store(tmp_path) -> Path:
    return tmp_path / "store"


@pytest.fixture(scope="session")
def s3_env() -> Iterator[dict[str, str]]:
    """A real S3-compatible server on a loopback port, for the session; its AWS_* variables are set
    in this process (child servers inherit them)."""
    pytest.importorskip("moto", reason="the object-store tests need the dev extra (moto[server])")
    from tests.server.s3 import s3_server

    with s3_server() as env, pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        yield env


@pytest.fixture(params=["local", "s3"])
def store_location(request, tmp_path) -> str:
    """An empty adapter store on each backend: a directory, and a fresh bucket on the S3 server."""
    if request.param == "local":
        return str(tmp_path / "store")
    from tests.server.s3 import new_bucket

    env = request.getfixturevalue("s3_env")
    return f"s3://{new_bucket(env)}/adapters"


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


def published(client: httpx.Client, lines: list[str], seconds: float = 5.0) -> str:
    """``/metrics`` once it holds ``lines`` (or after ``seconds``): in a group of processes, each
    publishes its counters every second (server/frontend/shared_metrics.py)."""
    deadline = time.monotonic() + seconds
    while True:
        text = client.get("/metrics").text
        if all(line in text for line in lines) or time.monotonic() > deadline:
            return text
        time.sleep(0.1)
