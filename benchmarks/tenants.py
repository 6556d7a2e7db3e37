"""Many tenants on one server: fair shares, per-key limits, their cost, and usage across replicas.

    python -m benchmarks.tenants                       # ~12 minutes on 2 cores
    python -m benchmarks.tenants --seconds 10 --share-seconds 30 --usage-requests 3000   # a quick look

The embedded demo model serves (``memvit serve`` as a child process, its small samples as uploads),
so that the model is fast and what is measured is the scheduling; every phase's load comes from
closed-loop clients with prepared requests (benchmarks/loadgen.py's client). This machine's speed
drifts with the other work on it, so each comparison alternates its two servers, phase by phase,
over ``--rounds`` rounds, and reports medians.

1. Latency: key B keeps 1 request (1 image) in flight, alone, then while key A keeps 32 in flight
   (1 image each, and 8 images each: a backlog many passes deep); fair batching on, and off (by
   arrival, as before keys had shares). B's p50 against its p50 alone.
2. Shares: A (weight 1) and B (weight 2) both backlogged (64 requests in flight each) for
   ``--share-seconds``: each key's share of the images answered against its weight's share.
3. Limits: key L (20 images/s, burst 10) sends as fast as 4 clients can while key F (no limit)
   does too: L's 429s, its images admitted over every window against 20 x T + 10, F's errors.
4. Cost: throughput of 32 clients (two keys) with fairness, limits (set, never reached) and usage
   on, against the server as it was before them (``--baseline``: a git revision of this repository,
   run from its own files; or the same code with all three off).
5. Usage: ``--usage-requests`` requests from 3 keys over 2 replicas sharing one store, one replica
   SIGKILLed and restarted part-way: the usage written against the requests answered; what is
   missing must be no more than what the killed replica answered in its last interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import REPO, argument_parser, environment
from benchmarks.loadgen import BOUNDARY, RawHttpClient
from memvit.server.keys import add_key
from memvit.server.policy import Limits, Policy
from memvit.server.usage import summarize
from memvit.server.usage_log import LocalUsageLog
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
        settings = {"MEMVIT_LOG_LEVEL": "warning", "MEMVIT_ADMIN_TOKEN": "bench-admin", **env}
        settings["MEMVIT_API_KEYS_FILE"] = str(self.keys_file) if keys else ""
        server = ServerProcess(None, self.tmp / f"store-{name}", stderr=None, **settings)
        self.running.append(server.start(timeout=180))
        return server

    def stop(self) -> None:
        for server in self.running:
            server.stop()


def latency(servers: Servers, fair: ServerProcess, fifo: ServerProcess, args) -> dict:
    print("\n## 1. B's latency, alone and beside A's backlog (p50 ms; medians of the rounds)\n")
    cases = {"alone": None, "A 32 x 1 image": 1, "A 32 x 8 images": 8}
    found: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for case, a_images in cases.items():
            for label, server in (("on", fair), ("off", fifo)):
                groups = {"B": Group(classify_request(server.port, servers.keys["b"]), 1)}
                if a_images:
                    a = classify_request(server.port, servers.keys["a"], a_images)
                    groups["A"] = Group(a, 32, a_images)
                since = drive(server.port, groups, args.seconds)
                found.setdefault((case, label), []).append(p50_ms(groups["B"].done, since))
                errors = sum(d.status != 200 for g in groups.values() for d in g.done)
                if errors:
                    found.setdefault((case, label + " errors"), []).append(errors)
    print("| A's load | B p50, fair | B p50, by arrival | fair / alone | by arrival / alone |")
    print("|---|--:|--:|--:|--:|")
    med = {k: statistics.median(v) for k, v in found.items()}
    for case in cases:
        on, off = med[(case, "on")], med[(case, "off")]
        print(f"| {case} | {on:.1f} | {off:.1f} | {on / med[('alone', 'on')]:.2f} | "
              f"{off / med[('alone', 'off')]:.2f} |")  # fmt: skip
    for (case, label), values in found.items():
        if label.endswith("errors"):
            print(
                f"non-200 answers, {case}, fairness {label.split()[0]}: {sum(values)} (503: A's queue full)"
            )
    return med


def shares(servers: Servers, fair: ServerProcess, fifo: ServerProcess, args) -> dict:
    seconds = args.share_seconds
    print(f"\n## 2. Shares of images, A (weight 1) and B (weight 2) both backlogged, {seconds:.0f} s\n")
    print("| fairness | A's images | B's images | B's share | B's share / its weight's (2/3) |")
    print("|---|--:|--:|--:|--:|")
    out = {}
    for label, server in (("on", fair), ("off", fifo)):
        groups = {who: Group(classify_request(server.port, servers.keys[who]), 64) for who in ("a", "b")}
        since = drive(server.port, groups, args.share_seconds)
        end = min(max(d.ended for d in g.done) for g in groups.values())
        counted = {w: sum(d.images for d in g.done if since <= d.ended <= end and d.status == 200)
                   for w, g in groups.items()}  # fmt: skip
        share = counted["b"] / (counted["a"] + counted["b"])
        out[label] = share / (2 / 3)
        print(f"| {label} | {counted['a']} | {counted['b']} | {share:.3f} | {out[label]:.3f} |")
    return out


def limits(servers: Servers, fair: ServerProcess, args) -> dict:
    rate, burst = 20.0, 10
    print(f"\n## 3. Limits: key L at {rate:g} images/s, burst {burst}, against a key without limits\n")
    groups = {"L": Group(classify_request(fair.port, servers.keys["l"]), 4),
              "F": Group(classify_request(fair.port, servers.keys["f"]), 4)}  # fmt: skip
    drive(fair.port, groups, args.seconds)
    ok = sorted((d for d in groups["L"].done if d.status == 200), key=lambda d: d.began)
    refused = sum(d.status == 429 for d in groups["L"].done)
    worst = 0.0
    # A request answered 200 was admitted between its send and its answer: those wholly inside a
    # window were admitted in it. Every window that starts at a send and ends at an answer.
    for i, first in enumerate(ok):
        for last in ok[i:]:
            if last.ended <= first.began:
                continue
            inside = sum(d.images for d in ok[i:] if d.ended <= last.ended)
            worst = max(worst, inside / (burst + rate * (last.ended - first.began)))
    span = ok[-1].ended - ok[0].began
    total = sum(d.images for d in ok) / (burst + rate * span)
    f_errors = sum(d.status != 200 for d in groups["F"].done)
    print(f"L: {len(ok)} answered, {refused} refused with 429; F: {len(groups['F'].done)} answered, "
          f"{f_errors} not 200")  # fmt: skip
    print(f"L's images in the worst window / (burst + rate x window): {worst:.3f}; over the whole "
          f"run ({span:.1f} s): {total:.3f}")  # fmt: skip
    return {"worst": worst, "refused": refused, "other_errors": f_errors}


def cost(servers: Servers, args) -> float:
    print("\n## 4. Throughput, 32 clients (two keys x 16), with fairness, limits and usage on\n")
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
    today = servers.start("today", keys=False, **baseline_env)
    on = servers.start("on")
    rates: dict[str, list[float]] = {"today": [], "on": []}
    for r in range(args.rounds):
        order = (("today", today), ("on", on)) if r % 2 == 0 else (("on", on), ("today", today))
        for name, server in order:
            keys = (servers.keys["a"], servers.keys["b"]) if name == "on" else (None, None)
            groups = {k or str(i): Group(classify_request(server.port, k), 16) for i, k in enumerate(keys)}
            since = drive(server.port, groups, args.seconds)
            done = [d for g in groups.values() for d in g.done if d.began >= since and d.status == 200]
            rates[name].append(32 / statistics.fmean(d.ended - d.began for d in done))
    print(f"baseline: {label}")
    print("| round | today (images/s) | fairness + limits + usage (images/s) | ratio |\n|--:|--:|--:|--:|")
    for i, (t, o) in enumerate(zip(rates["today"], rates["on"], strict=True), 1):
        print(f"| {i} | {t:.1f} | {o:.1f} | {o / t:.3f} |")
    return statistics.median(rates["on"]) / statistics.median(rates["today"])


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
                                threading.Thread(target=kill_and_restart, daemon=True).start()
            except (ConnectionError, asyncio.IncompleteReadError, OSError):
                await asyncio.sleep(0.2)  # the replica is down: try again once it is back

    async def main() -> None:
        await asyncio.gather(*(client(w, r) for w in answered for r in (0, 1) for _ in range(2)))

    asyncio.run(main())
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


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--seconds", type=float, default=15.0, help="per latency, limit and cost phase")
    parser.add_argument("--share-seconds", type=float, default=60.0, help="the shares' phase")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--usage-requests", type=int, default=10_000)
    parser.add_argument("--baseline", default="main", help="git revision for 'today' ('' : features off)")
    args = parser.parse_args(argv)
    print(environment("the embedded demo model", f"{len(SAMPLES)} demo samples (PNG)"))
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        keys_file = tmp / "keys.json"
        ids = {"a": "A", "b": "B", "c": "C", "l": "L", "f": "F"}
        policies = {"b": Policy(weight=2.0), "l": Policy(limits=Limits(images_per_second=20, burst=10)),
                    "a": Policy(limits=Limits(images_per_second=1e6, requests_in_flight=1000))}  # fmt: skip
        keys = {w: add_key(keys_file, ids[w], ["*"], read=True, write=False, policy=policies.get(w, Policy()))
                for w in ids}  # fmt: skip
        servers = Servers(tmp, keys_file, keys, ids)
        try:
            # Room for A's 32 x 8 images in the queue: what is measured is the order, not refusals.
            fair = servers.start("fair", MEMVIT_MAX_QUEUE="1024")
            fifo = servers.start("fifo", MEMVIT_MAX_QUEUE="1024", MEMVIT_FAIR_BATCHING="false")
            med = latency(servers, fair, fifo, args)
            share = shares(servers, fair, fifo, args)
            limited = limits(servers, fair, args)
            for server in (fair, fifo):
                server.stop()
            ratio = cost(servers, args)
            used = usage(servers, args)
        finally:
            servers.stop()
    b_ratio = med[("A 32 x 1 image", "on")] / med[("alone", "on")]
    deep = med[("A 32 x 8 images", "on")] / med[("alone", "on")]
    deep_off = med[("A 32 x 8 images", "off")] / med[("alone", "off")]
    print("\n## Goals\n")
    print(
        f"- B's p50 beside A (32 x 1 image) / alone: {b_ratio:.2f} (goal <= 1.5; by arrival: "
        f"{med[('A 32 x 1 image', 'off')] / med[('alone', 'off')]:.2f}); beside a deeper backlog "
        f"(32 x 8 images): {deep:.2f} (by arrival: {deep_off:.2f})"
    )
    print(f"- B's share / its weight's share, both backlogged: {share['on']:.3f} (goal within 0.90-1.10; "
          f"by arrival: {share['off']:.3f})")  # fmt: skip
    print(
        f"- L's worst window / (limit x window + burst): {limited['worst']:.3f} (goal <= 1), "
        f"{limited['refused']} 429s; other key's errors: {limited['other_errors']} (goal 0)"
    )
    print(f"- throughput with fairness, limits and usage / today's: {ratio:.3f} (goal >= 0.97)")
    print(
        f"- usage missing after a SIGKILL: {used['lost']} (goal 0 <= missing <= {used['bound']}, the "
        "killed replica's last interval)"
    )


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
