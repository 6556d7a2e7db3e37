"""A group of processes on one port, starting (server/frontend/listen.py, standin.py): probes answered
from the start, no process taking traffic before it can answer it, and a change acknowledged right
after the first ``/readyz`` kept across a restart. (A replica restarting under traffic: in
test_front_end.py, on that module's group.)"""

from __future__ import annotations

import subprocess
import sys
import time

import httpx

from memvit.server.frontend.remote import _no_migration
from memvit.server.registry.catalog import Catalog
from memvit.server.store import open_store
from tests.server.launcher import ServerProcess

DEMO = ("digits", "orientation")


def fresh() -> httpx.Client:
    """A new connection for each request, so that requests reach every process of the group."""
    return httpx.Client(timeout=30, limits=httpx.Limits(max_keepalive_connections=0))


def test_probes_from_the_start_and_changes_right_after_readyz_kept(tmp_path) -> None:
    """The demo in a new store, two API processes and a model process. While they load, /healthz is
    200 (Kubernetes' liveness) and /readyz 503, the port never closed; the first /readyz 200 means
    every request is answered (a process still connecting takes none); both demo adapters deleted
    at once, each acknowledged, are deleted in the store."""
    env = {"MEMVIT_API_PROCESSES": "2", "MEMVIT_FRONT_END": "model-process", "MEMVIT_LOG_LEVEL": "info"}
    log = (tmp_path / "log").open("ab")
    server = ServerProcess(None, tmp_path / "store", stderr=log, **env)  # the demo; anonymous admin
    command = [sys.executable, "-m", "memvit.server.cli", "serve"]
    server.proc = subprocess.Popen(command, env=server.env, stdout=subprocess.DEVNULL, stderr=log)
    seen: list[tuple[int, int]] = []  # (healthz, readyz) statuses; 0 for a refused connection
    try:
        with fresh() as client:
            deadline = time.monotonic() + 300
            while not seen or seen[-1][1] != 200:
                assert time.monotonic() < deadline and server.proc.poll() is None, seen[-5:]
                try:
                    seen.append((client.get(f"{server.url}/healthz").status_code,
                                 client.get(f"{server.url}/readyz").status_code))  # fmt: skip
                except httpx.TransportError:
                    seen.append((0, 0))
            deleted = [client.delete(f"{server.url}/adapters/{name}") for name in DEMO]
            assert [r.status_code for r in deleted] == [200, 200], [r.text for r in deleted]
            answers = [client.get(f"{server.url}/adapters/{DEMO[0]}").status_code for _ in range(6)]
            assert answers == [404] * 6  # gone for every process, none answering "not ready"
        server.stop()
    finally:
        server.stop()
        log.close()
    after = seen[next(i for i, (h, _) in enumerate(seen) if h == 200) :]  # the supervisor is up
    assert all(h == 200 for h, _ in after) and {r for _, r in after[:-1]} <= {503}, after
    assert len(after) > 3  # the load took a while: the probes were answered during it
    text = (tmp_path / "log").read_text()
    assert "the stand-in answers there" in text and "the stand-in stops answering there" in text, text[-3000:]
    # What a restart reads: the store's registry, from its journal (a restart would not seed again).
    catalog = Catalog(open_store(str(tmp_path / "store")))
    catalog.open(_no_migration, max_bytes=1 << 20)
    assert len(catalog) == 0 and catalog.version == 4  # two seeded, two deleted
