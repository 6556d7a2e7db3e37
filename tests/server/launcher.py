"""Starting real servers, for the HTTP tests and benchmarks/serve.py (no pytest needed).

``running_server``: uvicorn serving an app in a thread of this process; with ``api_processes`` > 1,
``memvit serve`` as a group of processes (server/frontend/). ``ServerProcess``: ``memvit serve`` as a
child process (restarts, SIGKILL, or keeping its CPU apart from the caller's).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import uvicorn

from memvit.server.http.app import create_app
from memvit.server.http.timeouts import header_timeout_protocol
from memvit.server.settings import Settings

REPO = Path(__file__).resolve().parents[2]


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port free now, never one this process handed out before: servers started at once each pick
    theirs before any of them binds it."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def wait_ready(url: str, timeout: float = 30.0, process: subprocess.Popen | None = None) -> None:
    """Until ``GET url/readyz`` answers 200; raises TimeoutError, or RuntimeError if ``process`` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server at {url} exited with {process.returncode} before it was ready")
        time.sleep(0.05)
    raise TimeoutError(f"{url} not ready after {timeout}s")


def settings_env(settings: Settings) -> dict[str, str]:
    """``settings`` as the MEMVIT_* variables a child ``memvit serve`` reads them back from."""
    env = {}
    for name, value in settings.model_dump().items():
        if value is None:
            continue
        if hasattr(value, "get_secret_value"):
            value = value.get_secret_value()
        elif isinstance(value, (list, tuple)):
            value = ",".join(map(str, value))
        env[f"MEMVIT_{name.upper()}"] = str(value)
    return env


@contextmanager
def running_server(
    settings: Settings, app=None, *, api_processes: int = 1, front_end: str = "model-process"
) -> Iterator[str]:
    """uvicorn serving ``app`` (default ``create_app(settings)``) in a thread; yields the URL once ready.

    ``api_processes`` > 1: ``memvit serve`` with that many API processes in the ``front_end`` mode,
    as a child process group (stopped with SIGTERM), from the same settings.

    ``MEMVIT_TEST_API_PROCESSES=N`` (N > 1) runs every server a test does not hand its own app as
    such a group (in ``MEMVIT_TEST_FRONT_END``'s mode, ``model-process`` by default): the HTTP tests,
    run once so, hold a group to one process's answers."""
    if app is None and api_processes == 1:
        api_processes = int(os.environ.get("MEMVIT_TEST_API_PROCESSES", "1"))
        front_end = os.environ.get("MEMVIT_TEST_FRONT_END", front_end)
    if api_processes > 1:
        with ServerGroup(settings, api_processes, front_end) as group:
            yield group.url
        return
    app = app if app is not None else create_app(settings)
    http = header_timeout_protocol(settings.header_timeout_seconds)  # as `memvit serve` does
    config = uvicorn.Config(app, host="127.0.0.1", port=settings.port, log_level="warning", http=http)
    server = uvicorn.Server(config)
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
    """``memvit serve`` as a child process on a free port.

    The environment is this process's, less any MEMVIT_WEIGHTS/MEMVIT_MODEL, plus the store, the port,
    a store poll of 0.2 s (tests of other replicas' changes) and ``env``, which overrides them.
    ``stderr``: where the server's log goes (``subprocess.PIPE``, the default, keeps it out of test
    output; ``None`` shares this process's stderr, for long runs that would fill a pipe nobody reads).
    """

    def __init__(
        self,
        weights: Path | None,
        store: Path,
        *,
        stderr: int | None = subprocess.PIPE,
        python: str = sys.executable,
        cwd: Path = REPO,
        **env: str,
    ) -> None:
        """``weights=None``: no model configured, so the server serves the embedded demo.

        ``python`` and ``cwd``: another interpreter (an installed wheel's venv) run from elsewhere.
        """
        self.python, self.cwd = python, cwd
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.stderr = stderr
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

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self, timeout: float = 60.0) -> ServerProcess:
        return self.spawn().wait_ready(timeout)

    def spawn(self) -> ServerProcess:
        """The process started, not waited for (``wait_ready``): several can load at once."""
        self.proc = subprocess.Popen(
            [self.python, "-m", "memvit.server.cli", "serve"],
            cwd=self.cwd,
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=self.stderr,
            text=True,
        )
        return self

    def wait_ready(self, timeout: float = 60.0) -> ServerProcess:
        try:
            wait_ready(self.url, timeout, self.proc)
        except (TimeoutError, RuntimeError):
            self.kill()
            raise
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)


class ServerGroup:
    """``memvit serve`` with ``api_processes`` processes in the ``front_end`` mode, from ``settings``
    (their port included), as a context manager: ready (every process) on entry, stopped with
    SIGTERM on exit. Its log goes to a file (a pipe nobody reads would fill): ``log()``."""

    def __init__(self, settings: Settings, api_processes: int = 2, front_end: str = "model-process") -> None:
        env = {
            **settings_env(settings),
            "MEMVIT_API_PROCESSES": str(api_processes),
            "MEMVIT_FRONT_END": front_end,
        }
        env["MEMVIT_LOG_LEVEL"] = "info"  # the supervisor says when every process is ready
        self._dir = Path(tempfile.mkdtemp(prefix="memvit-group-"))
        self._log = (self._dir / "group.log").open("ab")  # appended to, whoever reads it meanwhile
        self.server = ServerProcess(None, Path(settings.adapter_store), stderr=self._log, **env)
        self.server.port, self.server.url = settings.port, f"http://127.0.0.1:{settings.port}"
        self.url = self.server.url

    @property
    def pid(self) -> int | None:
        return self.server.pid

    def log(self) -> str:
        return (self._dir / "group.log").read_text(errors="replace")

    def children(self) -> list[int]:
        """The supervisor's child processes now (from /proc)."""
        found = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == self.pid:
                found.append(int(stat.parent.name))
        return found

    def started(self, name: str) -> int:
        """The pid the supervisor last started ``name`` (``model``, ``api-0``, ...) with."""
        pids = re.findall(rf"started {re.escape(name)} \(pid (\d+)\)", self.log())
        return int(pids[-1])

    def wait_for_log(self, text: str, timeout: float = 120.0, count: int = 1) -> None:
        deadline = time.monotonic() + timeout
        while self.log().count(text) < count:
            if time.monotonic() > deadline or self.server.proc.poll() is not None:
                raise RuntimeError(f"no {text!r} in the group's log; it ends:\n{self.log()[-4000:]}")
            time.sleep(0.05)

    def __enter__(self) -> ServerGroup:
        try:
            self.server.start(timeout=120)
            self.wait_for_log("processes ready")  # every process, not only the first to answer
        except (TimeoutError, RuntimeError) as exc:
            text = self.log()[-4000:]
            self.__exit__()
            raise RuntimeError(f"{exc}; its log ends:\n{text}") from None
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.server.stop()
        finally:
            self._log.close()
            shutil.rmtree(self._dir, ignore_errors=True)
