"""The engine's decode stage beside a saturated event loop: what the GIL's hand-offs cost it.

    python -m benchmarks.gil_convoy                      # 5, 1 and 0.25 ms switch intervals, ~1 min
    python -m benchmarks.gil_convoy --smoke              # a few seconds (CI)

On the H200 host one process (the default front end then) answered 680 img/s with JPEGs decoded on the
GPU, its engine's decode stage taking ~31 ms per batch of 17 where the GPU decodes and preprocesses
16 JPEGs in ~2.5 ms (RESULTS §3.15). The stage is a thread of a process whose event loop is
saturated (1.74 ms of CPU per image). The question this asks: does each tensor operation the stage
issues (each releases the GIL and takes it back; ~2 per image plus ~10 per batch when the pictures
differ in size) wait for a saturated loop to be made to drop the GIL (``sys.getswitchinterval()``,
5 ms by default), so that a shorter interval would help?

Here, on a CPU: the real ``DeviceDecoder.decode_batch`` (torchvision's CPU decoder, the batched
preprocessing) on a batch of small JPEGs of distinct sizes, timed alone and then beside an asyncio
loop kept saturated by coroutines doing Python work (the API side's stand-in), at several switch
intervals. Printed per interval: the stage's wall time per batch (median), its ratio to alone, and the
loop's work done per second (what a shorter interval costs the loop). A CPU stand-in: the op counts
are the GPU host's, the times this CPU's. On the 2-core build machine (RESULTS §3.15) the stage beside
the loop took 4.1-4.4x its time alone at every interval: the cores' contention, not the hand-offs.
"""

from __future__ import annotations

import asyncio
import io
import json
import statistics
import sys
import threading
import time

from PIL import Image

from benchmarks.common import argument_parser, environment
from memvit.memory_core import MemoryViT
from memvit.server.inference.device_decode import DeviceDecoder, Encoded
from memvit.server.inference.images import ImageDecoder

BASE = dict(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, num_classes=10)


def jpegs(n: int) -> list[Encoded]:
    """``n`` tiny JPEGs of distinct sizes (each its own resize, as photos of many cameras; tiny, so
    that the stage's own compute is small, as a GPU's launches are)."""
    out = []
    for i in range(n):
        buf = io.BytesIO()
        size = (12 + i, 10 + i)
        Image.radial_gradient("L").resize(size).convert("RGB").save(buf, format="JPEG", quality=90)
        out.append(Encoded(buf.getvalue(), f"p{i}.jpg", 1))
    return out


def stage_times(decoder: DeviceDecoder, items: list[Encoded], seconds: float) -> list[float]:
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        decoder.decode_batch(items)
        times.append(time.perf_counter() - start)
    return times


def on_a_thread(decoder: DeviceDecoder, items: list[Encoded], seconds: float) -> list[float]:
    """The stage alone, on a thread as the engine's is (after a warm-up: each size's first calls)."""
    times: list[float] = []
    thread = threading.Thread(
        target=lambda: (stage_times(decoder, items, 1.0), times.extend(stage_times(decoder, items, seconds)))
    )
    thread.start()
    thread.join()
    return times


def beside_loop(decoder: DeviceDecoder, items: list[Encoded], seconds: float) -> tuple[list[float], float]:
    """The stage on a thread while this thread's event loop is saturated; (stage times, loop work/s)."""
    done = 0
    stop = threading.Event()
    result: list[float] = []

    def stage() -> None:
        result.extend(stage_times(decoder, items, seconds))
        stop.set()

    async def busy() -> None:
        nonlocal done
        payload = {"tasks": [{"name": f"t{i}", "p": [0.1] * 5} for i in range(9)]}
        while not stop.is_set():
            json.loads(json.dumps(payload))  # ~tens of microseconds of Python, holding the GIL
            done += 1
            await asyncio.sleep(0)

    async def main() -> float:
        thread = threading.Thread(target=stage)
        start = time.perf_counter()
        thread.start()
        await asyncio.gather(*(busy() for _ in range(32)))
        elapsed = time.perf_counter() - start
        thread.join()
        return done / elapsed

    rate = asyncio.run(main())
    return result, rate


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--images", type=int, default=17, help="JPEGs per batch")
    parser.add_argument("--seconds", type=float, default=8.0, help="per interval")
    parser.add_argument("--intervals-ms", type=float, nargs="+", default=[5.0, 1.0, 0.25])
    parser.add_argument("--smoke", action="store_true", help="a few seconds (CI)")
    args = parser.parse_args(argv)
    if args.smoke:
        # Not Python's 5 ms: on the 2-core build machine one batch of the stage beside the loop took
        # 3-32 s at 5 ms (a whole smoke run 4-64 s), 0.05 s at 1 ms; the full run keeps 5 ms.
        args.seconds, args.intervals_ms = 0.5, [1.0, 0.25]
    engine = MemoryViT.from_timm("vit_tiny_patch16_224", **BASE)
    decoder = DeviceDecoder(ImageDecoder(engine, max_bytes=4_000_000, max_pixels=4_000_000), "cpu")
    items = jpegs(args.images)
    print(environment(f"{args.images} JPEGs of distinct sizes per batch, CPU decoder"))
    default = sys.getswitchinterval()
    alone = statistics.median(on_a_thread(decoder, items, args.seconds / 2))
    print(f"\nstage alone: {1e3 * alone:.2f} ms per batch\n")
    print("| switch interval ms | stage ms per batch beside the loop | x alone | loop work/s |")
    print("|--:|--:|--:|--:|")
    try:
        for interval in args.intervals_ms:
            sys.setswitchinterval(interval / 1e3)
            times, rate = beside_loop(decoder, items, args.seconds)
            beside = statistics.median(times)
            print(f"| {interval:g} | {1e3 * beside:.2f} | {beside / alone:.1f} | {rate:,.0f} |", flush=True)
    finally:
        sys.setswitchinterval(default)


if __name__ == "__main__":
    main()
