"""CPU per request of the HTTP front end, with the model pass and the pixels made negligible.

    python -m benchmarks.front_end_cpu                          # 1 process against 2 API processes, ~2 min
    python -m benchmarks.front_end_cpu --configs 1 --rounds 1   # one process only
    python -m benchmarks.front_end_cpu --smoke                  # a few seconds of each (CI)

What a request costs the processes that answer it, apart from the work of the model: the base is
one block of width 32 on 32x32 inputs, and each upload is a 32x32 JPEG carried in a 95 KiB file
(the size of the shared photos: APP15 segments of padding, which every decoder skips), so the bytes
move as a photo's would while decoding and the pass cost next to nothing. 8 adapters, every task
answered with its top label (``?top_k=1``), as the GPU suite's server step asks.

Each configuration is a ``memvit serve`` (tests/server/launcher.py): ``1`` one process, ``N`` N API
processes and one model process, ``N/replicas`` N replicas; each decoding JPEGs as ``--decode`` says
(``MEMVIT_DECODE_DEVICE``): ``device``, the GPU host's way (the front end only checks each upload,
the model's batch decodes it: torchvision's decoder, here on the CPU, in the model process), and
``cpu`` (the front end's workers decode with Pillow). Closed-loop clients (benchmarks/
loadgen.py) post the upload; the CPU time of every process of the server is read from /proc before
and after, and divided by the requests answered. CPU time, not throughput, because this machine's
two cores also run the load generator (and other work): CPU per request says what more cores would
do. The rounds alternate the configurations' order; the medians are reported:

- front end: the processes that speak HTTP (the one process, all of it; the API processes; the
  replicas),
- model: the model process (its batcher, the link, the pass),
- group: every process of the server (the supervisor too),
- and the group's CPU per request over the one process's, for each configuration.

``--pass-threads N`` starts the servers with ``OMP_NUM_THREADS=N``: the pass's intra-op threads. On
two shared cores torch's default (two) spin-waits at every parallel region of even this tiny pass,
and that CPU is the pass's, not the front end's: with ``1`` the pass is as negligible as it can be
made, and the figures are what the request path itself costs.

``--stub-pass`` replaces the pass itself with zeros of its shapes in every server process
(benchmarks/stub_pass.py): what is left is the request path alone, HTTP to answer, the batcher and
the decoding included.

``--fresh`` starts every server anew for each round: one instance of a configuration can measure a
third above another of the same code on this machine for all its rounds (RESULTS §3.14), so
rounds of fresh instances say more than rounds of one.

``--rate R`` paces the clients to R requests/s in all instead of a closed loop: every configuration
answers the same load (in a closed loop one process runs saturated and a group does not).

``--against DIR`` runs every configuration a second time on another checkout's code (`` then``):
``git archive <commit> server adapters memory_core | tar -x -C DIR``. Its processes may not carry the
role names (older code): their CPU is then all in ``group``.
"""

from __future__ import annotations

import asyncio
import io
import os
import re
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from PIL import Image

from benchmarks.common import argument_parser, environment, pin_malloc
from benchmarks.loadgen import classify_requests, load
from benchmarks.processes import RoleClock
from benchmarks.stub_pass import site_dir
from memvit.adapters import bundle_for
from memvit.memory_core import MemoryViT, save_base
from tests.factories import random_adapter
from tests.server.launcher import ServerProcess

BASE = dict(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, num_classes=10)
UPLOAD_BYTES = 95 * 1024


def padded_jpeg(size: int = UPLOAD_BYTES, side: int = 32) -> bytes:
    """A ``side`` x ``side`` JPEG of ``size`` bytes: the picture, after APP15 segments of padding."""
    buf = io.BytesIO()
    Image.radial_gradient("L").resize((side, side)).convert("RGB").save(buf, format="JPEG", quality=90)
    picture = buf.getvalue()
    padding, need = [], size - len(picture)
    while need > 4:
        n = min(need - 4, 65533 - 2)  # a segment's length counts its two length bytes
        padding.append(b"\xff\xef" + (n + 2).to_bytes(2, "big") + b"\0" * n)
        need -= n + 4
    return picture[:2] + b"".join(padding) + picture[2:]


@dataclass
class Round:
    requests: int
    statuses: dict[int, int]
    per_role: dict[str, float]  # CPU seconds per request
    client_ms: float
    rate: float
    batch: float | None = None  # mean images per batch in the phase (memvit_batch_images)
    threads: dict[str, float] | None = None  # the engine's process's CPU seconds per request by thread

    @property
    def group(self) -> float:
        return sum(self.per_role.values())


FRONT = {"server": "front", "api": "front", "replica": "front"}  # the processes that speak HTTP


def batches(port: int) -> tuple[float, float]:
    """``memvit_batch_images``' sum and count, as /metrics says now (every process's, merged)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    found = dict(re.findall(r"^memvit_batch_images_(sum|count) (\S+)$", text, re.M))
    return float(found.get("sum", 0)), float(found.get("count", 0))


def measure(
    server: ServerProcess, requests: list[bytes], clients: int, seconds: float, rate: float | None = None
) -> Round:
    """One phase of load; ``rate``: offered requests/s in all (paced clients), else a closed loop."""
    before = batches(server.port)
    clock = RoleClock(server.pid)
    result = asyncio.run(load("127.0.0.1", server.port, requests, clients, seconds, rate=rate))
    per_role: dict[str, float] = {}
    for role, cpu in clock.seconds().items():
        role = FRONT.get(role, role)
        per_role[role] = per_role.get(role, 0.0) + cpu / result.completed
    threads = {name: cpu / result.completed for name, cpu in clock.threads().items()}
    time.sleep(1.2)  # the model process publishes its metrics every second (shared_metrics.py)
    after = batches(server.port)
    images, formed = after[0] - before[0], after[1] - before[1]
    mean = images / formed if formed > 0 else None
    return Round(result.completed, result.statuses, per_role, result.client_cpu_ms, result.throughput, mean,
                 threads)  # fmt: skip


def against(checkout: Path, root: Path) -> Path:
    """A directory that, first on PYTHONPATH, makes ``memvit`` another checkout's code (its server/,
    adapters/ and memory_core/; this environment's libraries)."""
    shim = root / "then" / "memvit"
    shim.mkdir(parents=True)
    for part in ("server", "adapters", "memory_core"):
        (shim / part).symlink_to((checkout / part).resolve())
    return shim.parent


def start(
    name: str,
    weights: Path,
    root: Path,
    bundles: dict[str, bytes],
    then: Path | None,
    threads: int | None = None,
    stub: Path | None = None,
    wait: bool = True,
    tag: str = "",
) -> ServerProcess:
    """``name``: "<config> <decode>", e.g. "2 device", and " then" for ``then``'s code (see the
    module's doc). ``wait=False``: started, not yet ready (``wait_ready(300)``), so that several
    servers load at once. ``tag``: its store's name's suffix (another start of the same name)."""
    config, decode, *was = name.split()
    paths = [str(p) for p in (then if was else None, stub) if p is not None]
    extra = {"PYTHONPATH": os.pathsep.join(paths)} if paths else {}
    if threads is not None:
        extra["OMP_NUM_THREADS"] = str(threads)
    processes, _, mode = config.partition("/")
    store = root / f"store-{name.replace('/', '-').replace(' ', '-')}{tag}"
    store.mkdir()
    for adapter, data in bundles.items():
        (store / f"{adapter}.safetensors").write_bytes(data)
    server = ServerProcess(
        weights,
        store,
        stderr=None,
        MEMVIT_LOG_LEVEL="warning",
        MEMVIT_ADMIN_TOKEN="",
        MEMVIT_DECODE_DEVICE=decode,
        MEMVIT_STORE_POLL_SECONDS="2",
        MEMVIT_API_PROCESSES=processes,
        MEMVIT_FRONT_END=mode or "model-process",
        **extra,
    )
    return server.start(timeout=300) if wait else server.spawn()


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.3f}"


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--configs", nargs="+", default=["1", "2"], help='"1", "N" or "N/replicas"')
    parser.add_argument("--decode", nargs="+", default=["device", "cpu"], help="MEMVIT_DECODE_DEVICE values")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--rate", type=float, help="offered requests/s, paced (default: closed loop)")
    parser.add_argument("--seconds", type=float, default=10.0, help="per load phase")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pass-threads", type=int, help="OMP_NUM_THREADS of the servers (default: torch's)")
    parser.add_argument("--stub-pass", action="store_true", help="the pass replaced by zeros of its shapes")
    parser.add_argument("--smoke", action="store_true", help="one short round (CI)")
    parser.add_argument("--fresh", action="store_true", help="every server started anew for each round")
    parser.add_argument(
        "--against",
        type=Path,
        help="another checkout (e.g. git archive of a commit): each config again, on it",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.seconds, args.rounds = 2.0, 1
    malloc = pin_malloc()
    engine = MemoryViT.from_timm("vit_tiny_patch16_224", **BASE)
    upload = padded_jpeg()
    bundles = {
        f"task-{i}": bundle_for(random_adapter(f"task-{i}", engine, m=1, classes=10), engine).to_bytes()
        for i in range(8)
    }
    shape = "one block of width 32, 32x32 inputs"
    print(environment(shape, "8 adapters", f"{len(upload)}-byte JPEG", malloc))
    threads = "torch's default" if args.pass_threads is None else args.pass_threads
    threads = f"{threads}, the pass stubbed" if args.stub_pass else threads
    print(f"{args.clients} clients, {args.seconds:g} s per phase, {args.rounds} rounds, "
          f"intra-op threads: {threads}\n", flush=True)  # fmt: skip
    names = [
        f"{c} {d}{w}"
        for d in args.decode
        for c in args.configs
        for w in ("", " then")[: 1 + bool(args.against)]
    ]
    results: dict[str, list[Round]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        weights = root / "base.safetensors"
        save_base(engine.base, weights, arch="vit_tiny_patch16_224", model_kwargs=BASE)
        then = against(args.against, root) if args.against else None
        stub = site_dir(root) if args.stub_pass else None
        servers: dict[str, ServerProcess] = {}
        requests: dict[str, list] = {}

        def fresh(tag: str) -> None:  # every configuration's server started (at once), then warmed up
            for server in servers.values():
                server.stop()
            spawned = {
                n: start(n, weights, root, bundles, then, args.pass_threads, stub, wait=False, tag=tag)
                for n in names
            }
            servers.clear()
            servers.update(spawned)  # held before they are waited for: any that fails, the rest are stopped
            for server in spawned.values():
                server.wait_ready(300)
            requests.update({n: classify_requests("127.0.0.1", s.port, [upload]) for n, s in servers.items()})
            for n, s in servers.items():  # warm-up: connections, allocator, the first passes
                asyncio.run(load("127.0.0.1", s.port, requests[n], args.clients, min(args.seconds, 3.0)))

        try:
            fresh("")
            for r in range(args.rounds):
                if args.fresh and r > 0:
                    fresh(f"-{r}")
                for n in names if r % 2 == 0 else names[::-1]:
                    got = measure(servers[n], requests[n], args.clients, args.seconds, args.rate)
                    results[n].append(got)
                    roles_ms = ", ".join(f"{role} {ms(v)}" for role, v in sorted(got.per_role.items()))
                    mean = "-" if got.batch is None else f"{got.batch:.1f}"
                    busiest = ", ".join(f"{t} {ms(v)}" for t, v in list((got.threads or {}).items())[:5])
                    print(f"round {r + 1} {n}: {got.rate:.0f} req/s, CPU ms/request: {roles_ms}; "
                          f"mean batch {mean}; statuses {got.statuses}; engine's process by thread: "
                          f"{busiest}", flush=True)  # fmt: skip
        finally:
            for server in servers.values():
                server.stop()
    report(results, names)


def report(results: dict[str, list[Round]], names: list[str]) -> None:
    """Medians over the rounds; each group against one process decoding the same way."""

    def median(n: str, role: str | None) -> float | None:
        values = [r.group if role is None else r.per_role.get(role) for r in results[n]]
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    print("\n| config, decode | front end ms/req | model process ms/req | group ms/req | group / one "
          "process's | load generator ms/req | req/s | mean batch | non-200 |")  # fmt: skip
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|")
    for n in names:
        one = " ".join(["1", *n.split()[1:]])  # one process, decoding the same way, the same code
        group, base = median(n, None), median(one, None) if one in results else None
        bad = sum(k for r in results[n] for s, k in r.statuses.items() if s != 200)
        rate = statistics.median(r.rate for r in results[n])
        client = statistics.median(r.client_ms for r in results[n])
        against = "-" if base is None or group is None else f"{group / base:.3f}"
        sizes = [r.batch for r in results[n] if r.batch is not None]
        batch = f"{statistics.median(sizes):.1f}" if sizes else "-"
        print(
            f"| {n} | {ms(median(n, 'front'))} | {ms(median(n, 'model'))} | {ms(group)} | "
            f"{against} | {client:.3f} | {rate:.0f} | {batch} | {bad} |"
        )


if __name__ == "__main__":
    main()
