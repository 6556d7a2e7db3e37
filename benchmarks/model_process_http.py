"""A group's model process under HTTP load: its CPU per request, this checkout against another.

    python -m benchmarks.model_process_http --baseline ../main     # paired rounds, ~3 min
    python -m benchmarks.model_process_http --smoke

``memvit serve`` with two API processes and one model process (``MEMVIT_API_PROCESSES=2``), a base of
one block of width 32 on 32x32 inputs (its pass is real, and small), 8 adapters, each request a
32x32 JPEG answered for every task with its top label (``?top_k=1``), decoded by the API processes
(``MEMVIT_DECODE_DEVICE=cpu``) or, with ``--device-decode``, by the model process. Closed-loop
clients (benchmarks/loadgen.py); the CPU time of the model process (the supervisor's child named
``memvit-model``, or else the one it started first) and of the other children is read from /proc
and divided by the requests answered. Rounds alternate this checkout and ``--baseline`` (another
checkout's ``server``, ``adapters`` and ``memory_core`` served as the ``memvit`` package, first on
the server's PYTHONPATH); medians are reported. benchmarks/model_process_cpu.py measures the model
process alone with its pass stubbed (the 0.1 ms goal); this is the before/after of a whole group.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
from pathlib import Path

from benchmarks.common import argument_parser, environment
from benchmarks.loadgen import classify_requests, load
from benchmarks.model_process_cpu import BASE, cpu_seconds, small_jpeg
from memvit.adapters import bundle_for
from memvit.memory_core import MemoryViT, save_base
from tests.factories import random_adapter
from tests.server.launcher import ServerProcess


def children(supervisor: int) -> tuple[int, list[int]]:
    """The model process (named ``memvit-model``, or the first child the supervisor spawned) and the
    other spawned children (multiprocessing's resource tracker is none of them)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            comm = (stat.parent / "comm").read_text().strip()
            spawned = b"spawn_main" in (stat.parent / "cmdline").read_bytes() or comm.startswith("memvit-")
        except OSError:
            continue
        if int(fields[1]) == supervisor and spawned:
            found.append((comm != "memvit-model", int(fields[19]), int(stat.parent.name)))
    found.sort()
    return found[0][2], [pid for _, _, pid in found[1:]]


def package(checkout: Path, root: Path) -> Path:
    """A directory whose ``memvit`` package is ``checkout``'s code."""
    where = root / f"checkout-{checkout.resolve().name}"
    memvit = where / "memvit"
    memvit.mkdir(parents=True)
    (memvit / "__init__.py").write_text("")
    for part in ("server", "adapters", "memory_core"):
        (memvit / part).symlink_to(checkout.resolve() / part)
    return where


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--baseline", type=Path, help="another checkout, served in alternate rounds")
    parser.add_argument("--device-decode", action="store_true", help="JPEGs decoded by the model process")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.seconds, args.rounds = 2.0, 1
    engine = MemoryViT.from_timm("vit_tiny_patch16_224", **BASE)
    decode = "device" if args.device_decode else "cpu"
    print(environment("one block of width 32, 32x32 inputs", "8 adapters", f"decode={decode}"), flush=True)
    results: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        weights = root / "base.safetensors"
        save_base(engine.base, weights, arch="vit_tiny_patch16_224", model_kwargs=BASE)
        bundles = {
            f"task-{i}": bundle_for(random_adapter(f"task-{i}", engine, m=1, classes=10), engine).to_bytes()
            for i in range(8)
        }
        codes = {"this checkout": None}
        if args.baseline is not None:
            codes[f"baseline {args.baseline}"] = package(args.baseline, root)
        servers = {}
        try:
            for n, (name, path) in enumerate(codes.items()):
                store = root / f"store-{n}"
                store.mkdir()
                for adapter, data in bundles.items():
                    (store / f"{adapter}.safetensors").write_bytes(data)
                env = {} if path is None else {"PYTHONPATH": str(path)}
                servers[name] = ServerProcess(
                    weights, store, stderr=None, MEMVIT_LOG_LEVEL="warning", MEMVIT_ADMIN_TOKEN="",
                    MEMVIT_DECODE_DEVICE=decode, MEMVIT_STORE_POLL_SECONDS="2", MEMVIT_API_PROCESSES="2",
                    MEMVIT_FRONT_END="model-process", **env,
                ).start(timeout=300)  # fmt: skip
                results[name] = []
            requests = {
                name: classify_requests("127.0.0.1", s.port, [small_jpeg()]) for name, s in servers.items()
            }
            for name, server in servers.items():  # warm-up
                asyncio.run(load("127.0.0.1", server.port, requests[name], args.clients, 3.0))
            order = list(servers)
            for r in range(args.rounds):
                for name in order if r % 2 == 0 else order[::-1]:
                    server = servers[name]
                    model, others = children(server.pid)
                    pids = [model, *others]
                    before = {pid: cpu_seconds(pid) for pid in pids}
                    got = asyncio.run(
                        load("127.0.0.1", server.port, requests[name], args.clients, args.seconds)
                    )
                    spent = {pid: cpu_seconds(pid) - before[pid] for pid in pids}
                    ms_model = 1e3 * spent[model] / got.completed
                    ms_api = 1e3 * sum(spent[pid] for pid in others) / got.completed
                    results[name].append((ms_model, ms_api))
                    line = (
                        f"model process {ms_model:.3f}, API processes {ms_api:.3f}; statuses {got.statuses}"
                    )
                    print(
                        f"round {r + 1} {name}: {got.throughput:.0f} req/s, CPU ms/request: {line}",
                        flush=True,
                    )
        finally:
            for server in servers.values():
                server.stop()
    print("\n| served | model process CPU ms/request | API processes CPU ms/request |")
    print("| --- | --: | --: |")
    for name, rounds in results.items():
        model = statistics.median(m for m, _ in rounds)
        api = statistics.median(a for _, a in rounds)
        print(f"| {name} | {model:.3f} | {api:.3f} |")


if __name__ == "__main__":
    main()
