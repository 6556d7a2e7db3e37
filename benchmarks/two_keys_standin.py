"""The two-keys goal on a stand-in GPU: the engine loop in its GPU shape, the device's time as sleeps.

    python -m benchmarks.two_keys_standin                 # the H200's stage times, 3 rounds (~1 min)
    python -m benchmarks.two_keys_standin --smoke         # a short round (CI)

The goal (the GPU suite's `two keys` row): a light key with one request in flight keeps its p50
within 1.5x of its p50 alone while a heavy key keeps 32 in flight. At ba5e65b the H200 measured
3.3-3.4x. The engine loop (server/inference/engine_loop.py) runs here as it runs on a GPU: three
batches in flight (``depth=3``), two decode threads (lanes), a pass thread and a collector. What the
device would spend is a sleep, which releases the GIL as a device wait does: a batch's decode
stage ``DECODE`` = (per batch, per image) seconds and its pass ``PASS`` likewise, fitted to the
H200's server rows (RESULTS §3.16: decode 6.2-7.8 ms and pass 4.0-5.1 ms a batch of ~15, DeiT-Tiny
float32); one decode at a time, as torchvision's GPU decoder holds a lock, and one pass at a time.
The engine's own host work runs for real on a one-block base (the pass's network stubbed,
benchmarks/stub_pass.py). So the figure is the pipeline's order (which batch a light request joins,
what it waits behind), not HTTP's or the GPU's: a stand-in to try scheduling against before a lease.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
import types
from concurrent.futures import Future

import torch

from benchmarks.common import argument_parser, environment
from benchmarks.stub_pass import stubbed_device_pass
from memvit.memory_core import LiveAdapters, MemoryViT
from memvit.server.inference.device_runner import DeviceRunner
from memvit.server.inference.engine_loop import EngineLoop
from memvit.server.inference.jobs import Job
from memvit.server.telemetry.metrics import Metrics
from tests.factories import random_adapter

BASE = dict(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, num_classes=10)
DECODE = (1.0e-3, 0.37e-3)  # seconds a batch, and an image: nvJPEG and the batched preprocessing
PASS = (1.5e-3, 0.18e-3)  # the pass's graph replay and its answers' copies
HEAVY_IN_FLIGHT, MAX_BATCH = 32, 64
MARK = 1000.0  # the light key's image carries it in its first pixel: its batch's times are recorded
# Where a light request's time goes, each from the mark before: its batch formed and handed to the
# decoder, the decoder taken, its decode done and the pass thread holding it, the device taken, its
# pass done, its answer back.
MARKS = ("submitted", "to its batch", "waiting for the decoder", "decode, to the pass thread",
         "waiting for the device", "its pass", "to its answer")  # fmt: skip


class _Sink:
    def deliver(self, finished) -> None:
        for job, result in finished:
            job.context.set_result(result)


def standin_loop(engine: MemoryViT, adapters: list, max_batch: int = MAX_BATCH) -> EngineLoop:
    """The GPU's engine loop on this CPU, the device's time as sleeps (``DECODE``, ``PASS``); the
    light key's batches' times in ``loop.marks`` (``MARKS``)."""
    live = LiveAdapters(engine)
    live.install(engine.prepare_set(adapters))
    runner = DeviceRunner(engine, lanes=2)
    loop = EngineLoop(live, runner, max_batch=max_batch, max_wait=0.0, max_queue=4096, metrics=Metrics(),
                      depth=3)  # fmt: skip
    loop.marks = {name: [] for name in MARKS}
    decoder_lock, device_lock = threading.Lock(), threading.Lock()
    decode, launch = runner.decode, runner.launch

    def mark(name: str, light: bool) -> None:
        if light:
            loop.marks[name].append(time.perf_counter())

    def slow_decode(items, *lane):
        light = any(float(item[0, 0, 0]) == MARK for item in items)
        mark("to its batch", light)
        with decoder_lock:  # torchvision's GPU decoder: one call at a time
            mark("waiting for the decoder", light)
            time.sleep(DECODE[0] + DECODE[1] * len(items))
        return decode(items, *lane)

    def slow_launch(decoded, adapter_set, tasks, wants):
        light = bool((decoded.x[:, 0, 0, 0] == MARK).any())
        mark("decode, to the pass thread", light)
        with device_lock:  # the passes run one after another on the device
            mark("waiting for the device", light)
            time.sleep(PASS[0] + PASS[1] * decoded.x.shape[0])
        mark("its pass", light)
        return launch(decoded, adapter_set, tasks, wants)

    runner.decode, runner.launch = slow_decode, slow_launch
    return loop


def breakdown(marks: dict[str, list[float]]) -> dict[str, float]:
    """Median ms of each step of the light requests (``MARKS``), each from the one before."""
    n = min(len(times) for times in marks.values())
    return {
        later: 1e3 * statistics.median(marks[later][i] - marks[earlier][i] for i in range(n))
        for earlier, later in itertools.pairwise(MARKS)
    }


def _client(loop: EngineLoop, image, flow: str, stop: threading.Event, latencies: list[float]) -> None:
    sink, light = _Sink(), flow == "light"
    while not stop.is_set():
        future: Future = Future()
        began = time.perf_counter()
        if light:
            loop.marks["submitted"].append(began)
        loop.submit(Job([image], None, None, sink, top_k=1, flow=flow, context=future))
        future.result(30)
        latencies.append(time.perf_counter() - began)
        if light:
            loop.marks["to its answer"].append(time.perf_counter())


def measure(loop: EngineLoop, image, seconds: float, heavy: int) -> tuple[float, float]:
    """The light key's p50 (ms), one request in flight, beside ``heavy`` in flight of another key;
    and the heavy key's images a second. The light key's image is ``image`` marked (``MARK``)."""
    stop, light, flood = threading.Event(), [], []
    marked = image.clone()
    marked[0, 0, 0] = MARK
    for times in loop.marks.values():
        times.clear()
    threads = [
        threading.Thread(target=_client, args=(loop, image, "heavy", stop, flood)) for _ in range(heavy)
    ]
    threads.append(threading.Thread(target=_client, args=(loop, marked, "light", stop, light)))
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join()
    steady = light[len(light) // 4 :] or light  # the first quarter: the flood filling the pipeline
    return 1e3 * statistics.median(steady), len(flood) / seconds


def main(argv: list[str] | None = None) -> float:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--seconds", type=float, default=6.0, help="per phase")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--max-batch", type=int, default=MAX_BATCH, help="the engine loop's (the server's: 64)"
    )
    parser.add_argument("--smoke", action="store_true", help="one short round (CI)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.seconds, args.rounds = 1.5, 1
    engine = MemoryViT.from_timm("vit_tiny_patch16_224", **BASE)
    # this engine's network stubbed, not the class's: a test may run this in a process that goes on
    engine._device_pass = types.MethodType(stubbed_device_pass, engine)
    adapters = [random_adapter(f"task-{i}", engine, m=1, classes=10) for i in range(8)]
    image = torch.randn(3, 32, 32)
    print(environment("the engine loop's GPU shape (depth 3, 2 decode threads), the device as sleeps"))
    device = f"decode {DECODE[0] * 1e3:g} + {DECODE[1] * 1e3:g} ms an image, pass {PASS[0] * 1e3:g} + "
    device += f"{PASS[1] * 1e3:g} ms an image"
    print(f"{device}; heavy key {HEAVY_IN_FLIGHT} in flight; batches <= {args.max_batch}\n", flush=True)
    loop = standin_loop(engine, adapters, args.max_batch)
    loop.start()
    ratios = []
    try:
        for r in range(args.rounds):
            alone, _ = measure(loop, image, args.seconds / 2, 0)
            beside, heavy = measure(loop, image, args.seconds, HEAVY_IN_FLIGHT)
            ratios.append(beside / alone)
            print(f"round {r + 1}: light p50 alone {alone:.2f} ms, beside the flood {beside:.2f} ms, "
                  f"{beside / alone:.2f}x; the flood {heavy:,.0f} img/s", flush=True)  # fmt: skip
        steps = breakdown(loop.marks)  # the last round's, beside the flood
    finally:
        loop.stop()
    print(
        "\nthe light request beside the flood, median ms: "
        + ", ".join(f"{k} {v:.2f}" for k, v in steps.items())
    )
    ratio = statistics.median(ratios)
    print(f"light beside / alone (median of {len(ratios)}): {ratio:.2f}x (goal <= 1.5)")
    return ratio


if __name__ == "__main__":
    main()
