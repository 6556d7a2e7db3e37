"""Real Ray nodes on this machine, for the Ray Serve tests (no pytest needed).

Each node is ``ray start --block`` in its own process session, so killing every process of that
session kills the node whole (raylet, agents, its workers), as losing a machine would. Nodes get distinct
loopback addresses (127.0.0.2, 127.0.0.3, ...: all of 127/8 is loopback on Linux; Ray rewrites
127.0.0.1 itself to the machine's address), their own ports and worker-port ranges, and share one
temp dir under /tmp (Unix socket paths must stay short).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.server.launcher import free_port

RAY = str(Path(sys.executable).with_name("ray"))
# Worker ports sit below Linux's ephemeral range (32768+), where free_port() never lands.
_WORKER_PORTS = iter(range(20000, 32000, 400))


class RayNode:
    """One Ray node: the head (``head=None``) or a node joining ``head``."""

    def __init__(
        self,
        ip: str,
        temp_dir: Path,
        *,
        head: RayNode | None = None,
        num_cpus: int = 1,
        resources: dict[str, float] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.ip = ip
        self.temp_dir = temp_dir
        self.head = head
        self.num_cpus = num_cpus
        self.resources = resources or {}
        self.port: int | None = None
        self.log_path = temp_dir / f"node-{ip}.log"
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **(env or {})}
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        assert self.head is None and self.port is not None, "only a started head has a GCS address"
        return f"{self.ip}:{self.port}"

    def _args(self) -> list[str]:
        """``ray start`` with fresh ports (each attempt's own)."""
        low = next(_WORKER_PORTS)
        args = [
            RAY, "start", "--block", "--disable-usage-stats",
            f"--node-ip-address={self.ip}",
            f"--num-cpus={self.num_cpus}", "--num-gpus=0",
            f"--resources={json.dumps(self.resources)}",
            "--object-store-memory=100000000",  # the tests pass no objects: keep /dev/shm small
            "--include-log-monitor=false",  # nobody reads the logs live: one process less per node
            f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}", f"--metrics-export-port={free_port()}",
            f"--min-worker-port={low}", f"--max-worker-port={low + 399}",
        ]  # fmt: skip
        if self.head is None:
            self.port = free_port()
            return [
                *args, "--head", f"--port={self.port}", f"--temp-dir={self.temp_dir}",
                "--include-dashboard=false", f"--ray-client-server-port={free_port()}",
            ]  # fmt: skip
        return [*args, f"--address={self.head.address}"]

    def start(self, timeout: float = 180.0, attempts: int = 3) -> RayNode:
        """Starts the node; returns once ``ray start`` says it runs. On a starved machine Ray aborts by
        itself (its raylet waits 15 s, not configurable in Ray 2.60, for the dashboard agent to write its
        port file; a slow Python import misses that): then try again, else raise with its log."""
        for attempt in range(1, attempts + 1):
            offset = self.log_path.stat().st_size if self.log_path.exists() else 0
            with open(self.log_path, "ab") as log:
                # Its own session: every process of the node, and no one else's, can be found by it.
                self.proc = subprocess.Popen(
                    self._args(), env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            deadline = time.monotonic() + timeout
            while b"Ray runtime started" not in self.log_path.read_bytes()[offset:]:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.kill()
                    if attempt == attempts:
                        raise RuntimeError(f"ray node {self.ip} did not start:\n{self.log_tail()}")
                    break
                time.sleep(0.1)
            else:
                return self
        raise AssertionError("unreachable")

    def kill(self) -> None:
        """SIGKILL every process of the node, as losing the machine would: its session (Ray puts
        each worker in a process group of its own, but they all stay in the node's session)."""
        if self.proc is None:
            return
        for pid in session_pids(self.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""


def node_temp_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="memvit-ray-", dir="/tmp"))


def session_pids(sid: int) -> list[int]:
    """Every process in session ``sid`` (field 6 of /proc/PID/stat)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = (entry / "stat").read_text()
            # The command name (field 2) may hold spaces: fields are counted after its ')'.
            if int(stat[stat.rindex(")") + 2 :].split()[3]) == sid:
                found.append(int(entry.name))
    return found


def leftover_pids(temp_dir: Path) -> list[int]:
    """Processes whose command line names ``temp_dir``: what a node left behind (only ours)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if str(temp_dir).encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
    return found


def stop_all(nodes: list[RayNode], temp_dir: Path) -> None:
    """Kill every node, then any process still naming our temp dir; remove the temp dir."""
    for node in nodes:
        node.kill()
    for pid in leftover_pids(temp_dir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(temp_dir, ignore_errors=True)
