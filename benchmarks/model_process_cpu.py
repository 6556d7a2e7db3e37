"""CPU per request of the model process, with the model pass and the pixels stubbed out.

    python -m benchmarks.model_process_cpu                  # both decode paths, 3 rounds, ~1 min
    python -m benchmarks.model_process_cpu --smoke          # a few seconds of each (CI)
    python -m benchmarks.model_process_cpu --real-pass      # the tiny base's pass instead of the stub
    python -m benchmarks.model_process_cpu --paths device --clients 4 64   # its cost per batch and per image

The model process of a group only forms batches (docs/design.md §5): what it spends per request,
apart from the model's work, is its own overhead: reading the link, pinning the adapters, queueing,
routing, forming and cutting batches, answering. The goal is 0.1 ms. Here the model process is the
real one (``serve_model``, spawned as the supervisor spawns it), its pass stubbed
(benchmarks/stub_pass.py): the network's part of the pass returns zeros of its shapes, the plan and
the output are the real ones, so what is measured is everything but the model. 8 adapters
resident, every request unfiltered (the base and all 8 answered, each with its top label, as the GPU
suite's server step asks), one image each.

Two paths: ``cpu`` (the images cross as decoded tensors, as when API processes decode) and
``device`` (each crosses as a JPEG for the model process's device decoder: a 32x32 JPEG, so the
decoding itself is negligible). This process plays two API processes: two links, each with its
``RemoteRunner`` (server/frontend/remote.py) and its shared-memory arena, and closed-loop clients
on them. The model process's CPU time is read from /proc before and after each phase and divided by
the requests answered (CPU time, not throughput: this machine's cores also run the clients).

With several ``--clients`` counts (each in turn, every round), the batches differ in size, and the
model process's CPU is fitted as ``a`` per batch plus ``b`` per image over every phase (its batches and
images from its ``memvit_batch_images``). ``--against DIR`` runs a second model process on DIR's server/
(this checkout's memory_core and this process's side of the link), the two alternating phase by
phase: an A/B of the model process's code on the same load.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import multiprocessing
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image

from benchmarks.common import argument_parser, environment
from benchmarks.stub_pass import install as stub_the_pass
from memvit.adapters import bundle_for
from memvit.memory_core import MemoryViT, save_base
from tests.factories import random_adapter

BASE = dict(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, num_classes=10)
PATHS = ("cpu", "device")


def small_jpeg(side: int = 32) -> bytes:
    buf = io.BytesIO()
    Image.radial_gradient("L").resize((side, side)).convert("RGB").save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def batches(directory: Path) -> tuple[float, float]:
    """``memvit_batch_images``' sum and count, as the model process last published them (every second,
    server/frontend/shared_metrics.py)."""
    text = (directory / "model.prom").read_text()
    found = dict(re.findall(r"^memvit_batch_images_(sum|count) (\S+)$", text, re.M))
    return float(found.get("sum", 0)), float(found.get("count", 0))


def fit(phases: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(ms per batch, ms per image) of phases' (CPU ms, batches, images): least squares through 0."""
    import numpy as np

    cpu, formed, images = (np.array(column) for column in zip(*phases, strict=True))
    (per_batch, per_image), *_ = np.linalg.lstsq(np.stack([formed, images], 1), cpu, rcond=None)
    return float(per_batch), float(per_image)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _model(settings, directory: str, ready, stub: bool, profile: bool, then: str | None) -> None:
    """The model process, as the supervisor starts it, its pass stubbed (``stub``); ``profile``: its
    functions' CPU time, every thread's, printed when it stops (yappi, not a dependency); ``then``: a
    directory whose ``memvit/server`` is another checkout's (memvit is a namespace package: its path
    follows ``sys.path``), so the model process runs that server code with this memory_core."""
    import logging

    if then is not None:
        sys.path.insert(0, then)

    from memvit.server.frontend.model_process import serve_model

    logging.basicConfig(level="WARNING")
    if stub:
        stub_the_pass()
    if profile:
        import yappi

        yappi.set_clock_type("cpu")
        yappi.start()
    asyncio.run(serve_model(settings, Path(directory), ready.set))
    if profile:
        yappi.stop()
        out = io.StringIO()
        columns = {0: ("name", 80), 1: ("ncall", 9), 2: ("tsub", 8), 3: ("ttot", 8)}
        yappi.get_func_stats().sort("tsub").print_all(out=out, columns=columns)
        print("\n".join(out.getvalue().splitlines()[:50]), flush=True)


async def _phase(runners: list, items, clients: int, seconds: float) -> int:
    from memvit.server.inference.runner import Ask

    done, deadline = 0, time.perf_counter() + seconds

    async def ready():
        return items

    async def client(runner) -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            await runner.run(Ask(1, None, top_k=1), ready())
            done += 1

    await asyncio.gather(*(client(runners[i % len(runners)]) for i in range(clients)))
    return done


async def _connect(settings, directory: Path) -> tuple[list, list]:
    """Two API processes' sides of the link to one model process: their runners and closers."""
    from memvit.server.frontend.api_process import _build
    from memvit.server.frontend.model_process import SOCKET
    from memvit.server.frontend.remote import ModelLink
    from memvit.server.frontend.shm_arena import Arena

    runners, closers = [], []
    for _ in range(2):
        link = ModelLink(directory / SOCKET)
        await link.connect()
        arena = Arena(32 << 20)
        service = await asyncio.to_thread(_build, settings, link, arena, await link.call("info"))
        runners.append(service.pipeline.runner)
        closers.append((link, service, arena))
    return runners, closers


async def _drive(models: dict[str, tuple[Path, int]], path: str, args, phases: dict) -> None:
    """Phases on each model process (``models``: name -> its directory and pid), each client count
    in turn, the model processes alternating within a round."""
    import torch

    from memvit.server.inference.device_decode import Encoded

    items = torch.randn(1, 3, 32, 32) if path == "cpu" else [Encoded(small_jpeg(), "photo.jpg", 1)]
    linked = {name: await _connect(args.settings, directory) for name, (directory, _) in models.items()}
    for runners, _ in linked.values():
        await _phase(runners, items, max(args.clients), min(args.seconds, 2.0))  # warm-up
    for r in range(args.rounds):
        for clients in args.clients:
            for name, (directory, pid) in models.items():
                await asyncio.sleep(1.2)  # the model process publishes its metrics every second
                counted, before = batches(directory), cpu_seconds(pid)
                n = await _phase(linked[name][0], items, clients, args.seconds)
                cpu = 1e3 * (cpu_seconds(pid) - before)
                await asyncio.sleep(1.2)
                images, formed = (a - b for a, b in zip(batches(directory), counted, strict=True))
                phases.setdefault((name, clients), []).append((cpu, formed, images, n))
                print(f"  round {r + 1} {name} decode={path} clients={clients}: {n} requests, mean batch "
                      f"{images / max(formed, 1):.1f}, model process {cpu / n:.3f} ms CPU/request",
                      flush=True)  # fmt: skip
    for _, closers in linked.values():
        for link, service, arena in closers:
            await link.close()
            service.decode_pool.shutdown()
            arena.close()


def _start(context, settings, directory: Path, args, then: str | None):
    ready = context.Event()
    flags = (not args.real_pass, args.profile, then)
    child = context.Process(target=_model, args=(settings, str(directory), ready, *flags))
    child.start()
    while not ready.wait(1):
        if not child.is_alive():
            raise RuntimeError("the model process did not start")
    return child


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    parser.add_argument("--clients", type=int, nargs="+", default=[64], help="in flight (several: in turn)")
    parser.add_argument("--seconds", type=float, default=8.0, help="per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--real-pass", action="store_true", help="the tiny base's pass, not the stub")
    parser.add_argument("--smoke", action="store_true", help="one short round (CI)")
    parser.add_argument("--profile", action="store_true", help="the model process's profile (needs yappi)")
    parser.add_argument("--against", type=Path, help="also a model process on this checkout's server/")
    args = parser.parse_args(argv)
    if args.smoke:
        args.seconds, args.rounds = 1.0, 1
    from memvit.server.settings import Settings

    engine = MemoryViT.from_timm("vit_tiny_patch16_224", **BASE)
    stub = "stubbed pass" if not args.real_pass else "one block of width 32, 32x32 inputs"
    print(
        environment(stub, "8 adapters, every task answered", f"{args.clients} requests in flight"), flush=True
    )
    results: dict[str, dict] = {}
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        variants: dict[str, str | None] = {"now": None}
        if args.against is not None:
            (root / "then" / "memvit").mkdir(parents=True)
            (root / "then" / "memvit" / "server").symlink_to((args.against / "server").resolve())
            variants["then"] = str(root / "then")
        weights = save_base(
            engine.base, root / "base.safetensors", arch="vit_tiny_patch16_224", model_kwargs=BASE
        )
        for path, n in zip(args.paths, itertools.count()):
            store = root / f"store-{n}"
            store.mkdir()
            for i in range(8):
                adapter = random_adapter(f"task-{i}", engine, m=1, classes=10)
                (store / f"task-{i}.safetensors").write_bytes(bundle_for(adapter, engine).to_bytes())
            args.settings = Settings(_env_file=None, weights=weights, adapter_store=store, decode_device=path,
                                     usage_log=False, log_level="warning")  # fmt: skip
            children, models = [], {}
            try:
                for name, then in variants.items():
                    directory = root / f"run-{n}-{name}"
                    directory.mkdir()
                    children.append(_start(context, args.settings, directory, args, then))
                    models[name] = (directory, children[-1].pid)
                results[path] = {}
                asyncio.run(_drive(models, path, args, results[path]))
            finally:
                for child in children:
                    child.terminate()
                    child.join(30)
    _report(results)


def _report(results: dict[str, dict]) -> None:
    print("\n| decode | code | clients | mean batch | model process CPU ms/request (median) |")
    print("| --- | --- | --: | --: | --: |")
    for path, phases in results.items():
        for (name, clients), runs in phases.items():
            per_request = statistics.median(cpu / n for cpu, _, _, n in runs)
            batch = statistics.median(images / max(formed, 1) for _, formed, images, _ in runs)
            print(f"| {path} | {name} | {clients} | {batch:.1f} | {per_request:.3f} |")
    for path, phases in results.items():
        for name in dict.fromkeys(name for name, _ in phases):
            mine = [runs for (n, _), runs in phases.items() if n == name]
            every = [(cpu, formed, images) for runs in mine for cpu, formed, images, _ in runs]
            if len(mine) > 1:
                per_batch, per_image = fit(every)
                print(f"{path}, {name}: {per_batch:.3f} ms per batch + {per_image:.4f} ms per image "
                      f"(least squares over {len(every)} phases)")  # fmt: skip


if __name__ == "__main__":
    main()
