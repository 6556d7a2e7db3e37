"""A group of processes on one port, starting and restarting (server/frontend/listen.py, standin.py):
probes answered from the start, no process taking traffic before it can answer it, and a change
acknowledged right after the first ``/readyz`` kept across a restart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from memvit.server.settings import Settings
from tests.server.conftest import free_port
from tests.server.launcher import ServerGroup, ServerProcess
from tests.server.test_api import jpeg, post_image

DEMO = ("digits", "orientation")


def fresh() -> httpx.Client:
    """A new connection for each request, so that requests reach every process of the group."""
    return httpx.Client(timeout=30, limits=httpx.Limits(max_keepalive_connections=0))


def test_probes_are_answered_from_the_start_and_changes_right_after_readyz_are_kept(tmp_path) -> None:
    """The demo in a new store, two API processes and a model process: while they load, /healthz
    is 200 and /readyz 503; the first /readyz 200 means every request is answered (the processes
    still connecting take none); both demo adapters deleted at once stay deleted after a restart."""
    store = tmp_path / "store"
    env = {"MEMVIT_API_PROCESSES": "2", "MEMVIT_FRONT_END": "model-process", "MEMVIT_LOG_LEVEL": "info"}
    log = (tmp_path / "log").open("ab")
    server = ServerProcess(None, store, stderr=log, **env)  # the demo; loopback: anonymous admin
    try:
        server.start(timeout=120)  # returns at the first /readyz 200 (tests/server/launcher.py)
        with fresh() as client:
            deleted = [client.delete(f"{server.url}/adapters/{name}") for name in DEMO]
            assert [r.status_code for r in deleted] == [200, 200], [r.text for r in deleted]
            answers = [client.get(f"{server.url}/adapters/{DEMO[0]}").status_code for _ in range(6)]
            assert answers == [404] * 6  # gone for every process, none answering "not ready"
        server.stop()
        server.start(timeout=120)
        with fresh() as client:
            assert client.get(f"{server.url}/adapters").json()["adapters"] == []
    finally:
        server.stop()
        log.close()
    text = (tmp_path / "log").read_text()
    assert "the stand-in answers there" in text and "the stand-in stops answering there" in text, text[-3000:]


def test_while_loading_the_group_answers_probes(tmp_path) -> None:
    """From the moment the supervisor runs, /healthz answers 200 (Kubernetes' liveness), /readyz 503
    until a process is ready, then 200; the port is never closed in between."""
    store = tmp_path / "store"
    port = free_port()
    env = {"MEMVIT_API_PROCESSES": "2", "MEMVIT_FRONT_END": "replicas", "MEMVIT_LOG_LEVEL": "warning"}
    server = ServerProcess(None, store, **env)
    server.port, server.url = port, f"http://127.0.0.1:{port}"
    server.env["MEMVIT_PORT"] = str(port)
    command = [sys.executable, "-m", "memvit.server.cli", "serve"]
    server.proc = subprocess.Popen(
        command, env=server.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    seen: list[tuple[int, int]] = []  # (healthz, readyz) statuses, 0 for a refused connection
    try:
        deadline = time.monotonic() + 120
        with fresh() as client:
            while time.monotonic() < deadline:
                try:
                    seen.append((client.get(f"{server.url}/healthz").status_code,
                                 client.get(f"{server.url}/readyz").status_code))  # fmt: skip
                except httpx.TransportError:
                    seen.append((0, 0))
                if seen[-1][1] == 200:
                    break
                time.sleep(0.05)
    finally:
        server.stop()
    first = next(i for i, (h, _) in enumerate(seen) if h == 200)  # the supervisor is up
    after = seen[first:]
    assert after[-1] == (200, 200), seen[-5:]
    assert all(h == 200 for h, _ in after), after  # liveness answered throughout the load
    assert {r for _, r in after[:-1]} <= {503}, after
    assert len(after) > 3  # the load took a while: the probes were answered during it


def test_a_restarting_replica_takes_no_traffic_until_it_can_answer(tiny_weights, tmp_path) -> None:
    """A replica killed under traffic is restarted; while it loads, every request is answered by the
    other, never 503 "not ready" by the one that loads."""
    settings = Settings(
        weights=tiny_weights, adapter_store=tmp_path / "store", port=free_port(), max_wait_ms=2
    )
    image = jpeg()
    with ServerGroup(settings, 2, "replicas") as group:
        answers: list[tuple[float, int]] = []  # (when, status), 0 for a connection that broke
        stop = threading.Event()

        def traffic() -> None:
            with httpx.Client(
                base_url=group.url, timeout=30, limits=httpx.Limits(max_keepalive_connections=0)
            ) as c:
                while not stop.is_set():
                    try:
                        answers.append((time.monotonic(), post_image(c, image).status_code))
                    except httpx.TransportError:
                        answers.append((time.monotonic(), 0))

        thread = threading.Thread(target=traffic)
        thread.start()
        try:
            time.sleep(0.5)
            killed = time.monotonic()
            os.kill(group.started("replica-1"), signal.SIGKILL)
            group.wait_for_log("started replica-1", count=2, timeout=60)
            group.wait_for_log("listening on port", count=3, timeout=120)  # the new one listens
            time.sleep(0.5)
        finally:
            stop.set()
            thread.join()
    statuses = [status for _, status in answers]
    assert set(statuses) <= {200, 0} and statuses.count(200) > 10, {
        s: statuses.count(s) for s in set(statuses)
    }
    # Only the requests the SIGKILL cut can break; the new replica's load broke none.
    assert all(when - killed < 1.0 for when, status in answers if status == 0), answers
