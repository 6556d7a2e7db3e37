"""What requests see while an install grows the slot pools: the grown pools' graphs captured beside
serving, or by the batcher with the loop stopped.

On a GPU each pass is a graph replay, and a graph reads one generation of the slot pools: an adapter
loaded past their slots, memory length or classes grows them, and every graph of the grown pools is
captured again (server/inference/warmup.py). Two ways, alternating rounds:

- ``ahead`` (the server's): the installing thread grows the pools ahead, captures their graphs, then
  publishes them (``LiveAdapters.on_growth``); the engine loop goes on replaying the old ones;
- ``batcher`` (before; ``MEMVIT_GRAPHS_BESIDE_SERVING=false``): the batcher sees the pools grew,
  waits for the loop to drain and captures everything with the other stages idle: every request
  waits for all the captures.

On this CPU the graphs are stand-ins (benchmarks/host_counts.py: a replay runs the eager pass again);
a capture is the eager pass plus ``--capture-ms`` of busy host work holding the GIL, standing in for
a GPU capture's warm-up and recording. Clients ask for the adapters resident before the install (one
task each, or the base), closed-loop; one install adds ``--add`` adapters past the pools' 16 slots.

    python -m benchmarks.growth_stall --rounds 3      # ~1 min

Prints per round and mode: the install's seconds, the requests answered while it ran, the slowest
request and the p99 of those submitted from the install's start until the graphs were fresh again,
the steady p50 and the graphs captured on the serving path; then the medians and the ratio of the
slowest request, batcher / ahead. Then the same for shapes first met ("first use": the clients
start asking two tasks per image, shapes warm-up does not capture; ``ahead`` runs their first
passes eagerly while the engine-graphs thread captures them, ``batcher`` captures each in its
batch's way), the window the ``--settle-s`` after the switch.
"""

from __future__ import annotations

import random
import statistics
import sys
import threading
import time
from concurrent.futures import Future

import torch

from benchmarks.host_counts import StandInEvent, StandInGraphs
from memvit.memory_core import LiveAdapters
from memvit.memory_core.routing.staging import HostBuffers
from memvit.server.inference.device_runner import DeviceRunner
from memvit.server.inference.engine_loop import EngineLoop
from memvit.server.inference.jobs import Job
from memvit.server.inference.warmup import warm_up
from memvit.server.telemetry.metrics import Metrics
from tests.factories import random_adapter, tiny_engine

from .common import argument_parser, environment

MAX_BATCH = 16


class SlowCaptures(StandInGraphs):
    """Stand-in graphs whose capture also keeps the host busy for ``capture_s`` (GIL held): two
    thirds in its warm-up (a GPU capture's two eager passes), a third in its recording."""

    def __init__(self, capture_s: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.capture_s = capture_s

    def _warm_up(self, *args) -> None:
        _busy(2 * self.capture_s / 3)

    def _record(self, *args, **kwargs):
        _busy(self.capture_s / 3)
        return super()._record(*args, **kwargs)


def _busy(seconds: float) -> None:
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


class _Sink:
    def deliver(self, finished) -> None:
        now = time.perf_counter()
        for job, _ in finished:
            job.context.set_result(now)


TWO_TASKS = [("a0", "a1"), ("a2", "a3"), ("a0", "a3"), ("a1",)]  # shapes warm-up does not capture


def one_round(
    mode: str, capture_s: float, add: int, clients: int, settle_s: float, scenario: str = "growth"
) -> dict[str, float]:
    """``scenario``: "growth" (one install adds ``add`` adapters) or "first use" (the clients start
    asking two tasks per image: shapes warm-up did not capture)."""
    engine = tiny_engine()
    buffers = HostBuffers(pinned=False, new_event=StandInEvent.factory())
    engine.use_graphs(SlowCaptures(capture_s, buffers=buffers, replays=True))
    live = LiveAdapters(engine)
    live.replace_all([random_adapter(f"a{i}", engine, m=1 + i % 2, classes=5 + i) for i in range(4)])
    more = [engine.prepare(random_adapter(f"n{i}", engine, m=2, classes=5 + i)) for i in range(add)]
    size = engine.data_config()["input_size"]
    images = [torch.randn(*size, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    loop = EngineLoop(
        live, DeviceRunner(engine, None), max_batch=MAX_BATCH, max_wait=0.002, max_queue=4096,
        metrics=Metrics(), warm=lambda adapters: warm_up(engine, adapters, MAX_BATCH, 64),
        graphs_beside=mode == "ahead",  # MEMVIT_GRAPHS_BESIDE_SERVING
    )  # fmt: skip
    loop.start()
    if not engine.graph_captures:
        raise RuntimeError("the loop's warm-up captured no graph: see the log")
    sink, stop, asked, asks = _Sink(), threading.Event(), [], [[("a0",), ("a1",), ("a3",), ()]]

    def client(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            adapters = rng.choice(asks[-1])
            future: Future = Future()
            job = Job([rng.choice(images)], adapters, ["base", *adapters], sink, 1, False, context=future)
            sent = time.perf_counter()
            loop.submit(job)
            asked.append((sent, future.result(120)))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    try:
        for thread in threads:
            thread.start()
        time.sleep(settle_s)
        started, graphs = time.perf_counter(), engine._graphs()
        done_before, in_the_way = len(asked), graphs.captures
        if scenario == "growth":
            with live.exclusive() as current:
                for adapter in more:
                    current = current.with_adapter(adapter)
                live.install(current)
        else:
            asks.append(TWO_TASKS)
        installed = time.perf_counter()
        during = len(asked) - done_before
        while loop.graphs.stale():  # the batcher's captures (batcher mode), then the loop again
            time.sleep(0.001)
        fresh = time.perf_counter()
        time.sleep(settle_s)
    finally:
        stop.set()
        for thread in threads:
            thread.join(120)
        loop.stop()
    steady = [done - sent for sent, done in asked if sent < started]
    end = max(fresh, installed) if scenario == "growth" else started + settle_s
    window = [done - sent for sent, done in asked if started <= sent <= end]
    window += [done - sent for sent, done in asked if sent < started and done > started]
    return {
        "install s": installed - started,
        "answered during install": during,
        "captures in the way": graphs.captures - in_the_way,
        "eager passes": graphs.eager_passes,
        "slowest ms": 1e3 * max(window),
        "p99 ms (window)": 1e3 * _quantile(window, 0.99),
        "steady p50 ms": 1e3 * statistics.median(steady),
    }


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--capture-ms", type=float, default=20.0, help="host time a capture stands for")
    parser.add_argument("--add", type=int, default=20, help="adapters the install adds (past 16 slots)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--settle-s", type=float, default=1.0)
    parser.add_argument(
        "--gil-switch-ms", type=float, default=0.5, help="the GIL's switch interval (a GPU server's default)"
    )
    args = parser.parse_args(argv)
    sys.setswitchinterval(args.gil_switch_ms / 1e3)
    print(environment())
    print(
        f"capture {args.capture_ms} ms (stand-in), {args.add} adapters added, {args.clients} clients, "
        f"GIL switch interval {args.gil_switch_ms} ms"
    )
    latency = ["slowest ms", "p99 ms (window)", "steady p50 ms", "captures in the way"]
    for scenario, columns in (
        ("growth", ["install s", "answered during install", *latency]),
        ("first use", [*latency, "eager passes"]),
    ):
        _scenario(scenario, columns, args)


def _scenario(scenario: str, columns: list[str], args) -> None:
    print(f"\n{scenario}:\n\n| round | mode | " + " | ".join(columns) + " |")
    print("|---|---|" + "--:|" * len(columns))
    results: dict[str, list[dict[str, float]]] = {"ahead": [], "batcher": []}

    def line(label: str, mode: str, row: dict[str, float]) -> None:
        print(f"| {label} | {mode} | " + " | ".join(f"{row[c]:.3g}" for c in columns) + " |", flush=True)

    for r in range(args.rounds):
        for mode in ("ahead", "batcher") if r % 2 == 0 else ("batcher", "ahead"):
            row = one_round(mode, args.capture_ms / 1e3, args.add, args.clients, args.settle_s, scenario)
            results[mode].append(row)
            line(str(r + 1), mode, row)
    medians = {m: {c: statistics.median(r[c] for r in rows) for c in columns} for m, rows in results.items()}
    for mode, row in medians.items():
        line("median", mode, row)
    ratio = medians["batcher"]["slowest ms"] / medians["ahead"]["slowest ms"]
    print(f"\nslowest request, {scenario}: batcher / ahead = {ratio:.1f}x")


if __name__ == "__main__":
    main()
