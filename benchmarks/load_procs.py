"""Closed-loop (or paced) HTTP load from several processes, every answer checked.

One asyncio process spends ~0.1-0.2 ms of CPU per request (benchmarks/loadgen.py's raw sockets), so
it tops out at a few thousand requests a second, below what a GPU host serves; ``run_load`` spreads
the clients over ``processes`` worker processes (``python -m benchmarks.load_procs``, which imports
no torch: a second to start), started together at an agreed time, and merges what they saw:

- img/s counts only 200 answers (a quick 503 is not throughput);
- every 200 answer is checked by ``answers.check`` against that image's reference (its answer
  alone, at batch 1: benchmarks/answers.py); wrong answers and non-200 answers are counted by
  reason (``statuses``: "503 NotReadyError: ...", "200 wrong: logits off by 0.2 in task ...");
- latencies of the requests sent in the window (its first quarter is ramp-up), p50 and p99;
- the workers' own CPU seconds, for the CPU per image of the load generator.

Throughput in a closed loop comes from the response-time law (X = N / R: ``clients`` over the mean
latency of the window's requests, times the share of them answered 200), as benchmarks/loadgen.py
explains; paced, from the 200s counted in the window.
"""

from __future__ import annotations

import asyncio
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.answers import prepared, reason_of
from benchmarks.loadgen import RawHttpClient


@dataclass
class Job:
    """What one worker runs: its clients, against ``requests`` (prepared HTTP), from ``start``."""

    host: str
    port: int
    requests: list[bytes]
    names: list[str]  # the image each request posts (its reference's key)
    references: dict[str, dict[str, list[float]]] | None
    tolerance: float
    clients: int
    first: int  # this worker's first client's number (their requests are spread over the images)
    total_clients: int
    start: float  # time.time() at which every worker begins
    seconds: float
    rate: float | None  # offered requests/s in all (paced), or None (closed loop)
    images: int = 1  # per request


@dataclass
class Seen:
    """What one worker (or, merged, all of them) saw."""

    latencies: list[float] = field(default_factory=list)  # the window's requests
    window_ok: int = 0  # of those, answered 200 and right
    answered: int = 0  # every request, ramp-up and tail included
    ok: int = 0
    statuses: Counter = field(default_factory=Counter)  # "200", "503 ...", "200 wrong: ..." -> count
    examples: dict[str, str] = field(default_factory=dict)  # a reason -> one body that shows it
    cpu_s: float = 0.0

    def merge(self, other: Seen) -> None:
        self.latencies += other.latencies
        self.window_ok += other.window_ok
        self.answered += other.answered
        self.ok += other.ok
        self.statuses.update(other.statuses)
        for reason, body in other.examples.items():
            self.examples.setdefault(reason, body)
        self.cpu_s += other.cpu_s


async def _run(job: Job) -> Seen:
    seen = Seen()
    window_start, deadline = job.start + job.seconds / 4, job.start + job.seconds
    open_in_window = 0
    finished = asyncio.Event()
    refs = prepared(job.references)  # once, not per answer
    await asyncio.sleep(max(0.0, job.start - time.time()))

    async def client(i: int) -> None:
        nonlocal open_in_window
        async with RawHttpClient(job.host, job.port) as http:
            n = i
            period = job.total_clients / job.rate if job.rate else 0.0
            next_send = job.start + (i / job.total_clients) * period
            while not finished.is_set():
                k = n % len(job.requests)
                n += 1
                if period:
                    await asyncio.sleep(max(0.0, next_send - time.time()))
                    next_send += period
                began = time.time()
                counted = began < deadline
                open_in_window += counted
                try:
                    status, body = await http.exchange(job.requests[k])
                    reason = reason_of(status, body, job.names[k], refs, job.tolerance)
                except (OSError, asyncio.IncompleteReadError) as exc:  # reset, refused: counted, go on
                    body, reason = b"", f"no answer: {type(exc).__name__}"
                    http.writer.close()  # the next request reconnects
                ended = time.time()
                seen.answered += 1
                seen.statuses[reason] += 1
                if reason == "200":
                    seen.ok += 1
                elif reason not in seen.examples:
                    seen.examples[reason] = body[:2000].decode("utf-8", "replace")
                if counted:
                    open_in_window -= 1
                    if began >= window_start:
                        seen.latencies.append(ended - began)
                        seen.window_ok += reason == "200"
                if ended >= deadline and open_in_window == 0:
                    finished.set()

    cpu0 = time.process_time()
    await asyncio.gather(*(client(job.first + i) for i in range(job.clients)))
    seen.cpu_s = time.process_time() - cpu0
    return seen


@dataclass(frozen=True)
class Load:
    """The merged figures of one load."""

    throughput: float  # images/s answered 200 and right
    p50_ms: float
    p99_ms: float
    answered: int
    ok: int
    statuses: dict[str, int]
    examples: dict[str, str]
    client_cpu_s: float  # the load generator's processes, together


def run_load(
    host: str,
    port: int,
    requests: list[bytes],
    names: list[str],
    clients: int,
    seconds: float,
    *,
    references: dict | None = None,
    tolerance: float = 1e-3,
    processes: int = 1,
    rate: float | None = None,
    images: int = 1,
) -> Load:
    """``clients`` clients over ``processes`` workers; see the module's doc."""
    processes = max(1, min(processes, clients))
    start = time.time() + 1.0  # every worker started (no torch to import) and connected by then
    with tempfile.TemporaryDirectory(prefix="memvit-load-") as tmp:
        workers, first = [], 0
        for w in range(processes):
            share = clients // processes + (w < clients % processes)
            job = Job(host, port, requests, names, references, tolerance, share, first, clients, start,
                      seconds, rate, images)  # fmt: skip
            first += share
            path = Path(tmp) / f"job-{w}.pickle"
            path.write_bytes(pickle.dumps(job))
            workers.append(subprocess.Popen([sys.executable, "-m", "benchmarks.load_procs", str(path)],
                                            stdout=subprocess.PIPE))  # fmt: skip
        seen = Seen()
        for worker in workers:
            out, _ = worker.communicate(timeout=seconds + 300)
            if worker.returncode != 0:
                raise RuntimeError(f"a load worker failed (status {worker.returncode})")
            seen.merge(pickle.loads(out))
    if len(seen.latencies) < 2:
        raise RuntimeError(f"only {len(seen.latencies)} requests in the window: run longer than {seconds}s")
    q = statistics.quantiles(seen.latencies, n=100)
    share_ok = seen.window_ok / len(seen.latencies)
    if rate:
        throughput = images * seen.window_ok / (seconds * 3 / 4)
    else:
        throughput = images * share_ok * clients / statistics.fmean(seen.latencies)
    return Load(throughput, 1e3 * statistics.median(seen.latencies), 1e3 * q[98], seen.answered, seen.ok,
                dict(seen.statuses), seen.examples, seen.cpu_s)  # fmt: skip


def main() -> None:
    from benchmarks import load_procs  # this module by its name (not __main__), for pickle

    job: Job = pickle.loads(Path(sys.argv[1]).read_bytes())
    try:  # libuv's loop, as the server's: less of the load generator's CPU per request
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    sys.stdout.buffer.write(pickle.dumps(run(load_procs._run(job))))


if __name__ == "__main__":
    main()
