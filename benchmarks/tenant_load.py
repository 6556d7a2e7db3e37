"""Driving several tenants' load at memvit servers, for benchmarks/tenants.py: prepared /classify
requests per key, closed-loop groups of clients, what each answered and when, and the servers the
phases alternate between."""

from __future__ import annotations

import asyncio
import contextlib
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.common import REPO
from benchmarks.loadgen import BOUNDARY, RawHttpClient
from tests.server.launcher import ServerProcess

SAMPLES = sorted((REPO / "server" / "demo" / "samples").glob("*.png"))


def classify_request(port: int, key: str | None, images: int = 1) -> bytes:
    """One prepared ``POST /classify?top_k=1`` with ``images`` of the demo's samples."""
    parts = b"".join(
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="image"; filename="s{i}.png"\r\n'
        "Content-Type: image/png\r\n\r\n".encode()
        + SAMPLES[i % len(SAMPLES)].read_bytes()
        + b"\r\n"
        for i in range(images)
    )
    body = parts + f"--{BOUNDARY}--\r\n".encode()
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    head = (
        f"POST /classify?top_k=1 HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{auth}"
        f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


@dataclass
class Done:
    began: float
    ended: float
    status: int
    images: int


@dataclass
class Group:
    request: bytes
    clients: int
    images: int = 1
    done: list[Done] = field(default_factory=list)


async def _drive(port: int, groups: dict[str, Group], seconds: float) -> float:
    """Every group's clients for ``seconds``; returns when the window counted from starts."""
    stop = time.perf_counter() + seconds

    async def client(group: Group) -> None:
        while time.perf_counter() < stop:
            # A refusal from the headers alone (a 429 at the edge) closes the connection, as the body
            # was never read: open another and send again.
            with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
                async with RawHttpClient("127.0.0.1", port) as http:
                    while time.perf_counter() < stop:
                        began = time.perf_counter()
                        status = await http.send(group.request)
                        group.done.append(Done(began, time.perf_counter(), status, group.images))

    start = time.perf_counter()
    await asyncio.gather(*(client(g) for g in groups.values() for _ in range(g.clients)))
    return start + seconds / 4  # the first quarter fills the pipeline


def drive(port: int, groups: dict[str, Group], seconds: float) -> float:
    return asyncio.run(_drive(port, groups, seconds))


def passes(port: int) -> tuple[float, float, float]:
    """The server's fused passes so far: their count, their images and their seconds (/metrics)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    found = dict(re.findall(r"^(memvit_\w+_(?:sum|count)) (\S+)$", text, re.M))
    return (float(found["memvit_batch_images_count"]), float(found["memvit_batch_images_sum"]),
            float(found["memvit_fused_pass_seconds_sum"]))  # fmt: skip


def p50_ms(done: list[Done], since: float) -> float:
    return 1e3 * statistics.median(d.ended - d.began for d in done if d.began >= since and d.status == 200)


@dataclass
class Servers:
    """The servers of one run, their keys and their stores (removed by ``stop``)."""

    tmp: Path
    keys_file: Path
    keys: dict[str, str]  # by short name: a, b, c, l, f
    ids: dict[str, str]  # their ids in the keys file
    running: list[ServerProcess] = field(default_factory=list)

    def start(self, name: str, *, keys: bool = True, **env: str) -> ServerProcess:
        settings = {"MEMVIT_LOG_LEVEL": "warning", "MEMVIT_ADMIN_TOKEN": "bench-admin"}
        settings["MEMVIT_API_KEYS_FILE"] = str(self.keys_file) if keys else ""
        settings.update(env)
        server = ServerProcess(None, self.tmp / f"store-{name}", stderr=None, **settings)
        self.running.append(server.start(timeout=180))
        return server

    def stop(self) -> None:
        for server in self.running:
            server.stop()
