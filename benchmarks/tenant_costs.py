"""What tenancy costs, for benchmarks/tenants.py: throughput and CPU per image with fairness, weights,
limits and usage on against the server before them (phase 4), and usage written across two replicas,
one killed part-way, against the requests answered (phase 5)."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import os
import signal
import statistics
import subprocess
import threading
import time
from pathlib import Path

from benchmarks.common import REPO
from benchmarks.loadgen import RawHttpClient
from benchmarks.serve_measures import process_cpu
from benchmarks.tenant_load import (
    Group,
    Servers,
    classify_request,
    drive,
)
from memvit.server.tenancy.key_file import load_or_empty, write_ring
from memvit.server.tenancy.policy import Policy
from memvit.server.tenancy.usage import summarize
from memvit.server.tenancy.usage_log import LocalUsageLog


def cost(servers: Servers, args) -> float:
    print("\n## 4. Throughput, 32 clients (two keys x 16), with fairness, weights, limits and usage on\n")
    baseline_env = {"MEMVIT_FAIR_BATCHING": "false", "MEMVIT_USAGE_LOG": "false"}
    label = "the same code, fairness, limits and usage off"
    if args.baseline:
        try:
            tree = _checkout(args.baseline, servers.tmp / "baseline")
            # Its memvit first on the path: `python -m memvit.server.cli` runs that revision's files.
            baseline_env = {"PYTHONPATH": f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
            label = f"revision {args.baseline} (its own files)"
        except (OSError, subprocess.CalledProcessError) as exc:
            print(f"(cannot check out {args.baseline}: {exc}; comparing against the features off)")
    # The same keys for both; the baseline's file without weights and limits, which it would refuse.
    plain = servers.tmp / "keys-plain.json"
    ring = load_or_empty(servers.keys_file)
    write_ring(plain, ring.replace(keys=tuple(dataclasses.replace(k, policy=Policy()) for k in ring.keys)))
    today = servers.start("today", keys=False, MEMVIT_API_KEYS_FILE=str(plain), **baseline_env)
    on = servers.start("on")
    rates: dict[str, list[float]] = {"today": [], "on": []}
    cpu: dict[str, list[float]] = {"today": [], "on": []}  # the server's CPU ms per image
    for r in range(args.cost_rounds):
        order = (("today", today), ("on", on)) if r % 2 == 0 else (("on", on), ("today", today))
        for name, server in order:
            groups = {k: Group(classify_request(server.port, servers.keys[k]), 16) for k in ("a", "b")}
            cpu0 = process_cpu(server.pid)
            since = drive(server.port, groups, args.cost_seconds)
            cpu1 = process_cpu(server.pid)
            answered = [d for g in groups.values() for d in g.done if d.status == 200]
            window = [d for d in answered if d.began >= since]
            rates[name].append(32 / statistics.fmean(d.ended - d.began for d in window))
            if cpu0 is not None and cpu1 is not None:
                cpu[name].append(1e3 * (cpu1 - cpu0) / len(answered))
    print(f"baseline: {label}")
    print("| round | today: images/s | CPU ms/image | on: images/s | CPU ms/image | images/s ratio |")
    print("|--:|--:|--:|--:|--:|--:|")
    ratios = []
    for i in range(args.cost_rounds):
        t, o = rates["today"][i], rates["on"][i]
        ratios.append(o / t)
        cells = [f"{cpu[n][i]:.2f}" if len(cpu[n]) > i else "-" for n in ("today", "on")]
        print(f"| {i + 1} | {t:.1f} | {cells[0]} | {o:.1f} | {cells[1]} | {o / t:.3f} |")
    if cpu["today"] and cpu["on"]:
        efficiency = statistics.median(cpu["today"]) / statistics.median(cpu["on"])
        print(f"images per CPU-second, on / today (medians): {efficiency:.3f}")
    return statistics.median(ratios)


def _checkout(revision: str, into: Path) -> Path:
    """``revision``'s server, adapters and memory_core as an importable ``memvit`` in ``into``."""
    into.mkdir(parents=True)
    command = ["git", "-C", str(REPO), "archive", revision, "server", "adapters", "memory_core"]
    archive = subprocess.run(command, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    package = into / "memvit"
    package.mkdir()
    for name in ("server", "adapters", "memory_core"):
        (package / name).symlink_to(into / name)
    return into


def usage(servers: Servers, args) -> dict:
    interval = 1.0
    print(f"\n## 5. Usage: {args.usage_requests} requests, 3 keys, 2 replicas, one SIGKILLed once\n")
    env = {
        "MEMVIT_USAGE_INTERVAL_SECONDS": str(interval),
        "MEMVIT_ADAPTER_STORE": str(servers.tmp / "shared"),
    }
    replicas = [servers.start("r1", **env), servers.start("r2", **env)]
    answered: dict[str, int] = dict.fromkeys(("a", "b", "c"), 0)
    by_killed: list[float] = []  # when the killed replica answered each request
    killed_at: list[float] = []
    state = {"count": 0, "killing": False}
    lock = threading.Lock()

    def kill_and_restart() -> None:
        victim = replicas[1]
        killed_at.append(time.perf_counter())
        victim.kill(signal.SIGKILL)
        victim.start(timeout=180)  # the same port and store; a new process, a new replica name
        state["killing"] = False

    async def client(who: str, replica: int) -> None:
        while state["count"] < args.usage_requests:
            server = replicas[replica]
            try:
                async with RawHttpClient("127.0.0.1", server.port) as http:
                    request = classify_request(server.port, servers.keys[who])
                    while state["count"] < args.usage_requests:
                        status = await http.send(request)
                        if status != 200:
                            continue
                        with lock:
                            state["count"] += 1
                            answered[who] += 1
                            if replica == 1 and not killed_at:
                                by_killed.append(time.perf_counter())
                            if state["count"] == args.usage_requests * 2 // 5 and not state["killing"]:
                                state["killing"] = True
                                threading.Thread(target=kill_and_restart, name="restart", daemon=True).start()
            except (ConnectionError, asyncio.IncompleteReadError, OSError):
                await asyncio.sleep(0.2)  # the replica is down: try again once it is back

    async def main() -> None:
        await asyncio.gather(*(client(w, r) for w in answered for r in (0, 1) for _ in range(2)))

    asyncio.run(main())
    for thread in threading.enumerate():  # a restart still under way
        if thread.name == "restart":
            thread.join()
    for server in replicas:
        server.stop()  # SIGTERM: each writes what it counted since its last record
    today = datetime.datetime.now(datetime.timezone.utc).date()
    rows = summarize(LocalUsageLog(servers.tmp / "shared"), today - datetime.timedelta(days=1), today)
    recorded = {
        w: sum(r.requests for r in rows if r.key == servers.ids[w] and r.task == "base") for w in answered
    }
    lost = sum(answered.values()) - sum(recorded.values())
    bound = sum(1 for t in by_killed if t > killed_at[0] - interval) if killed_at else 0
    print("| key | answered | in the usage log |\n|---|--:|--:|")
    for w in answered:
        print(f"| {servers.ids[w]} | {answered[w]} | {recorded[w]} |")
    print(f"missing: {lost}; the killed replica answered {bound} in its last {interval:g} s interval")
    return {"lost": lost, "bound": bound}
