"""A model batch's CPU on its own thread against the whole process's, the pass stubbed.

    python -m benchmarks.batch_cpu                        # batches of 1, 5 and 16, top 1 and top 5
    python -m benchmarks.batch_cpu --against /tmp/then    # and another checkout's server code, alternating
    python -m benchmarks.batch_cpu --smoke                # a few hundred batches (CI)

What the model process's engine thread does for a batch, in a loop, on one thread: the device
decoder's batch (torchvision's JPEG decoder on this CPU), the batched preprocessing, the pass with
its network stubbed (benchmarks/stub_pass.py: plan, index and output are the real ones), the
batch's answers and every request's cut. The base is one block of width 32 on 32x32 inputs with 8
adapters, each upload a 95 KiB JPEG that decodes to 32x32 (benchmarks/front_end_cpu.py's), one
request per image asking every task.

Two CPU figures per batch: the loop's thread (``time.thread_time``) and the whole process's
(``getrusage``). They differ by what other threads do meanwhile: torch's intra-op workers, when an
operation forks the pool. libgomp's worker spins after each parallel region waiting for the next, so
one small fork per batch, a batch every millisecond, keeps a second core busy (server/inference/
host_answers.py): ``process / thread`` says whether a batch keeps to its thread (1.0) or not (~2).
Each configuration runs in a fresh process (``--threads``: its intra-op threads, torch's default
otherwise); with ``--against`` the rounds alternate the two codes.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import argument_parser
from benchmarks.front_end_cpu import against as shim_for

REPO = Path(__file__).resolve().parents[1]


def measure(batch: int, top_k: int, batches: int) -> dict[str, float]:
    """In this process: ``batches`` batches of ``batch`` images (after a warm-up), CPU and wall ms per
    batch."""
    import resource
    import time

    from benchmarks.front_end_cpu import BASE, padded_jpeg
    from benchmarks.stub_pass import install
    from memvit.memory_core import MemoryViT
    from memvit.server.inference.answers import Want
    from memvit.server.inference.device_decode import DeviceDecoder
    from memvit.server.inference.device_runner import DeviceRunner
    from memvit.server.inference.images import ImageDecoder
    from tests.factories import random_adapter

    install()
    engine = MemoryViT.from_timm("vit_tiny_patch16_224", **BASE)
    adapters = [random_adapter(f"task-{i}", engine, m=1, classes=10) for i in range(8)]
    loaded = engine.prepare_set(adapters)
    decoder = DeviceDecoder(ImageDecoder(engine, max_bytes=4_000_000, max_pixels=4_000_000), "cpu")
    runner = DeviceRunner(engine, decoder)
    upload = padded_jpeg()
    items = [decoder.prepare(upload, f"image-{i}") for i in range(batch)]
    wants = [Want(i, i + 1, top_k, False) for i in range(batch)]

    def once() -> None:
        ran = runner.run(items, loaded, None, wants)
        for want in wants:
            ran.cut(want, None, 1, len(adapters))

    for _ in range(max(20, batches // 10)):
        once()

    def process() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    thread, whole, wall = time.thread_time(), process(), time.perf_counter()
    for _ in range(batches):
        once()
    thread, whole = time.thread_time() - thread, process() - whole
    wall = time.perf_counter() - wall
    return {"thread": 1e3 * thread / batches, "process": 1e3 * whole / batches, "wall": 1e3 * wall / batches}


def run(batch: int, top_k: int, batches: int, threads: int | None, then: Path | None) -> dict[str, float]:
    """``measure`` in a fresh process (``then``: first on its path, another checkout's code)."""
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    paths = [str(p) for p in (then, REPO) if p is not None]
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
    call = f"measure({batch}, {top_k}, {batches})"
    code = f"import json; from benchmarks.batch_cpu import measure; print(json.dumps({call}))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--batches", type=int, default=1500, help="timed batches per run")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 5, 16], help="images per batch")
    parser.add_argument("--top-k", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, help="intra-op threads (OMP_NUM_THREADS; default torch's)")
    parser.add_argument("--against", type=Path, help="another checkout's server/, adapters/, memory_core/")
    parser.add_argument("--smoke", action="store_true", help="one round of 300 batches of 5, top 1 (CI)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.batches, args.sizes, args.top_k, args.rounds = 300, [5], [1], 1
    with tempfile.TemporaryDirectory() as tmp:
        then = shim_for(args.against, Path(tmp)) if args.against else None
        codes = {"now": None, **({"then": then} if then else {})}
        results: dict[tuple, list[dict[str, float]]] = {}
        for r in range(args.rounds):
            for size in args.sizes:
                for k in args.top_k:
                    names = list(codes) if r % 2 == 0 else list(codes)[::-1]
                    for name in names:
                        got = run(size, k, args.batches, args.threads, codes[name])
                        results.setdefault((size, k, name), []).append(got)
                        print(f"round {r + 1} batch {size} top {k} {name}: thread {got['thread']:.3f}, "
                              f"process {got['process']:.3f} ms", flush=True)  # fmt: skip
    print("\n| batch | top k | code | thread CPU ms/batch | process CPU ms/batch | process / thread |")
    print("|--:|--:|---|--:|--:|--:|")
    for (size, k, name), runs in results.items():
        thread = statistics.median(x["thread"] for x in runs)
        whole = statistics.median(x["process"] for x in runs)
        print(f"| {size} | {k} | {name} | {thread:.3f} | {whole:.3f} | {whole / thread:.2f} |")


if __name__ == "__main__":
    main()
