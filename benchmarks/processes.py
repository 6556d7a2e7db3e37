"""A server's processes by role, and the CPU time each has used (Linux /proc).

``memvit serve`` is one process, or a supervisor whose children the supervisor names by role
(server/frontend/supervisor.py): ``memvit-model``, ``memvit-api-<i>``, ``replica-<i>``; whatever
else it started (multiprocessing's resource tracker) is ``other``.
"""

from __future__ import annotations

import os
from pathlib import Path


def _stat_seconds(stat: Path) -> float:
    """User and system CPU seconds of a /proc ``stat`` file (a process's or one thread's)."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds ``pid`` (all its threads) has used; 0 once it is gone."""
    try:
        return _stat_seconds(Path(f"/proc/{pid}/stat"))
    except OSError:
        return 0.0


def roles(pid: int) -> dict[int, str]:
    """``pid``'s process and its children by role: ``server`` (one process), or ``supervisor``,
    ``model``, ``api``, ``replica`` and ``other``."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            comm = (stat.parent / "comm").read_text().strip()
        except OSError:
            continue
        if int(fields[1]) == pid:
            role = "model" if comm == "memvit-model" else "api" if comm.startswith("memvit-api-") else None
            found[int(stat.parent.name)] = role or ("replica" if comm.startswith("replica-") else "other")
    return {pid: "supervisor" if found else "server", **found}


def thread_seconds(pid: int) -> dict[str, float]:
    """CPU seconds of ``pid``'s threads by the name the kernel shows (memvit names its engine and
    link threads: server/telemetry/os_names.py). A thread takes its creator's name: torch's intra-op
    workers carry the name of the thread whose operation first forked the pool (an engine thread's,
    often), so a name's first thread (the lowest id) counts as ``name`` and the others that carry
    it as ``name+`` (its pool's workers spinning, say); unnamed threads carry the process's name."""
    out: dict[str, float] = {}
    seen: set[str] = set()
    for task in sorted(Path(f"/proc/{pid}/task").glob("[0-9]*"), key=lambda t: int(t.name)):
        try:
            name, seconds = (task / "comm").read_text().strip(), _stat_seconds(task / "stat")
        except OSError:  # the thread ended
            continue
        key = f"{name}+" if name in seen else name
        seen.add(name)
        out[key] = out.get(key, 0.0) + seconds
    return out


class RoleClock:
    """CPU seconds by role between ``__init__`` and ``seconds()`` (processes found at the start), and
    by thread of the process that runs the engine (``threads()``: the model process, or the one)."""

    def __init__(self, pid: int) -> None:
        self.roles = roles(pid)
        self.before = {p: cpu_seconds(p) for p in self.roles}
        engine = [p for p, role in self.roles.items() if role in ("model", "server")]
        self.engine = engine[0] if engine else None
        self.threads_before = thread_seconds(self.engine) if self.engine is not None else {}

    def seconds(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for p, role in self.roles.items():
            out[role] = out.get(role, 0.0) + cpu_seconds(p) - self.before[p]
        return out

    def threads(self) -> dict[str, float]:
        """The engine's process's CPU seconds since ``__init__`` by thread name, busiest first (a
        thread started since counts from its start)."""
        if self.engine is None:
            return {}
        now = thread_seconds(self.engine)
        spent = {name: now[name] - self.threads_before.get(name, 0.0) for name in now}
        return dict(sorted(((n, s) for n, s in spent.items() if s > 0), key=lambda kv: -kv[1]))
