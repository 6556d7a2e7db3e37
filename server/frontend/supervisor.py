"""``memvit serve`` with ``MEMVIT_API_PROCESSES`` > 1: one port, several processes, one group.

The supervisor reserves the port (bound, not listening) and every API process listens on it with
``SO_REUSEPORT``: the kernel spreads the connections over the processes by their addresses. (One
listening socket shared by all was measured first: whichever process woke first accepted, and
32 clients connecting at once could all land on one replica, halving the replicas' throughput on
this 2-core machine.) It owns a private temp dir (the model process's socket, the processes'
metrics) and starts the children with ``spawn`` (a fresh interpreter each; nothing torch set up
here is inherited):

- model-process: the model process and N API processes; replicas: N replicas.
- An API process or replica listens on the port once it can answer (listen.py); until one does,
  the supervisor answers there (``/healthz`` 200, the rest 503 with ``Retry-After``: standin.py).
- A child that dies is restarted; the model process restarted is reconnected to by the API
  processes, which answer 503 meanwhile. A model process or replica that exits before it was ever
  ready (bad weights, an unreachable store: its log says why) stops the group with exit status 1,
  and so do more than ``MAX_RESTARTS`` restarts in ``RESTART_WINDOW`` seconds.
- SIGTERM or SIGINT: the API processes (or replicas) stop first, each finishing its running
  requests (up to 10 s, as one process does), then the model process (its batcher, and the usage
  since the last record); whatever is still alive after ``STOP_SECONDS`` is killed. Exit status 0.
"""

from __future__ import annotations

import logging
import multiprocessing
import shutil
import signal
import socket
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.context import SpawnProcess
from pathlib import Path

from ..settings import Settings
from ..telemetry.os_names import set_os_name
from .api_process import api_main
from .model_process import model_main
from .standin import StandIn

log = logging.getLogger("memvit.server.supervisor")
MAX_RESTARTS, RESTART_WINDOW = 5, 60.0
STOP_SECONDS = 20.0


@dataclass
class Child:
    name: str
    target: object
    args: tuple
    process: SpawnProcess | None = None
    ready: object = None  # a multiprocessing Event, set once the child serves
    ever_ready: bool = False
    must_start: bool = False  # a model process or replica: dying before ready stops the group
    restarts: deque = field(default_factory=deque)


def reserve(host: str, port: int) -> socket.socket:
    """The port, bound with ``SO_REUSEPORT`` and not listening: no connection comes to it, no other
    program can take the port, and port 0 becomes a port the children can listen on."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def comm_name(name: str) -> str:
    """A child's name as ``ps``, ``top`` and /proc/<pid>/comm show it (Linux keeps 15 characters):
    ``memvit-model``, ``memvit-api-3``, ``replica-12``."""
    return f"memvit-{name}" if len(name) <= 8 else name


def run_named(name: str, target: Callable[..., None], *args: object) -> None:
    """A child's entry point: ``target(*args)`` under ``name`` (``comm_name``)."""
    set_os_name(name)
    target(*args)


class Supervisor:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.mode = settings.front_end_mode
        self.context = multiprocessing.get_context("spawn")
        self.directory = Path(tempfile.mkdtemp(prefix="memvit-front-"))  # 0700: only this user
        self.sock = reserve(settings.host, settings.port)
        port = self.sock.getsockname()[1]
        self.stopping = False
        self.all_ready = False
        n = settings.api_processes
        self.children: list[Child] = []
        if self.mode == "model-process":
            self.children.append(Child("model", model_main, (settings, self.directory), must_start=True))
        role = "replica" if self.mode == "replicas" else "api"
        for i in range(n):
            args = (settings, port, self.directory, i, self.mode, n)
            self.children.append(Child(f"{role}-{i}", api_main, args, must_start=self.mode == "replicas"))
        self.front = [c for c in self.children if c.name != "model"]  # those that listen on the port
        self.standin = StandIn(settings.host, port, self._listening)
        self._answered = False  # whether a child answered the port at the last look

    def _listening(self) -> bool:
        """Whether a child listens on the port (its ready event: set once it listens; a new one
        for each start). Asked from the stand-in's thread too."""
        return any(c.ready is not None and c.ready.is_set() for c in self.front)

    def _start(self, child: Child) -> None:
        child.ready = self.context.Event()
        child.process = self.context.Process(
            target=run_named,
            args=(comm_name(child.name), child.target, *child.args, child.ready),
            name=f"memvit-{child.name}",
            daemon=False,
        )
        child.process.start()
        log.info("started %s (pid %d)", child.name, child.process.pid)

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        log.warning(
            "serving on http://%s:%d: %s front end, %d API process(es)",
            self.settings.host, self.sock.getsockname()[1], self.mode, self.settings.api_processes,
        )  # fmt: skip
        try:
            self.standin.start()  # probes are answered from the first moment
            for child in self.children:
                self._start(child)
            while not self.stopping:
                answered = self._listening()
                if answered != self._answered:
                    self._answered = answered
                    self.standin.update()
                status = self._watch()
                if status is not None:
                    return status
                time.sleep(0.1)
            return 0
        finally:
            self._stop_all()
            self.standin.close()
            self.sock.close()
            shutil.rmtree(self.directory, ignore_errors=True)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stopping = True

    def _watch(self) -> int | None:
        """Restart what died; a status when the group must end."""
        for child in self.children:
            process = child.process
            assert process is not None
            if not child.ever_ready and child.ready.is_set():
                child.ever_ready = True
                if not self.all_ready and all(c.ever_ready for c in self.children):
                    self.all_ready = True
                    log.warning("all %d processes ready", len(self.children))  # as "serving on" is
            if process.is_alive() or self.stopping:
                continue
            child.ready.clear()  # it no longer listens (its socket went with it)
            if child.must_start and not child.ever_ready:
                log.error("%s exited (status %s) before it was ready; stopping", child.name, process.exitcode)
                return 1
            now = time.monotonic()
            while child.restarts and now - child.restarts[0] > RESTART_WINDOW:
                child.restarts.popleft()
            if len(child.restarts) >= MAX_RESTARTS:
                log.error("%s died %d times in %.0f s; stopping", child.name, MAX_RESTARTS + 1,
                          RESTART_WINDOW)  # fmt: skip
                return 1
            child.restarts.append(now)
            log.warning("%s (pid %d) exited with status %s; restarting it", child.name, process.pid,
                        process.exitcode)  # fmt: skip
            self._start(child)
        return None

    def _stop_all(self) -> None:
        """The API processes first (their requests finish through the model), then the model."""
        front = [c for c in self.children if c.name != "model"]
        back = [c for c in self.children if c.name == "model"]
        for group in (front, back):
            alive = [c.process for c in group if c.process is not None and c.process.is_alive()]
            for process in alive:
                process.terminate()
            deadline = time.monotonic() + STOP_SECONDS
            for process in alive:
                process.join(max(0.0, deadline - time.monotonic()))
                if process.is_alive():
                    log.error("%s did not stop in %.0f s; killing it", process.name, STOP_SECONDS)
                    process.kill()
                    process.join(5)


def serve_group(settings: Settings) -> int:
    """Serve with several processes until SIGTERM; the exit status."""
    return Supervisor(settings).run()
