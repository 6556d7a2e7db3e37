"""Adapter-aware routing on Ray Serve against random routing and Serve's default, on the same Zipf trace.

    pip install -e '.[ray]' && python -m benchmarks.ray_routing      # ~9 minutes on 2 CPU cores

A two-node Ray cluster on this machine (tests/server/ray_cluster.py: two `ray start` nodes on
loopback) runs three applications side by side, each docker/ray/serve-config.yaml's deployment with
two replicas, one per node, sharing one local adapter store of ``--adapters`` small adapters:
- ``affinity`` (route prefix /affinity): adapter-aware routing, as shipped (server/ray/router.py);
- ``random``: each request to a replica drawn uniformly at random (benchmarks/ray_uniform_router.py);
- ``two-choices``: the shipped router with ``adapter_affinity: false``, i.e. Serve's default, power
  of two choices, which with two replicas sends each request to the one with the shorter queue.
Each replica keeps at most ``--resident`` adapters. Clients replay one Zipf(``--s``) trace of
`/classify?tasks=<adapter>` requests (one small image each) through Ray's HTTP proxy on the head,
closed loop. Both applications get the warm-up, then the same rounds of the trace, alternating
which goes first. Per round and application: the hit rate (adapters asked for that were resident,
from each replica's own count, ``describe()``) and p50/p99 latency; medians over rounds of the
per-round ratios.
"""

from __future__ import annotations

import io
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import DEIT_TINY, argument_parser, deit_tiny_engine, environment
from benchmarks.ray_proxy import CALLBACK
from benchmarks.ray_rounds import (
    APPS,
    Round,
    run_segment,
    serve_config,
    wait_running,
)
from benchmarks.registry_fill import bundles, fill_local, zipf_trace
from memvit.memory_core import MemoryViT, save_base
from memvit.server.store import LocalStore
from tests.server.launcher import free_port
from tests.server.ray_cluster import RayNode, node_temp_dir, stop_all

log = logging.getLogger("benchmarks.ray_routing")
REPO_ROOT = Path(__file__).resolve().parents[1]
BASELINES = ("random", "two-choices")
SLOTS = {f"slot_{app}": 1 for app in APPS}  # each node offers one per app: one replica per node each


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--adapters", type=int, default=1000, help="adapters registered")
    parser.add_argument("--resident", type=int, default=50, help="MEMVIT_RESIDENT_ADAPTERS per replica")
    parser.add_argument("--s", type=float, default=1.1, help="Zipf exponent")
    parser.add_argument("--warmup", type=int, default=1500, help="trace requests before the rounds")
    parser.add_argument("--per-round", type=int, default=600, help="trace requests per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--load-factor", type=float, default=1.25, help="the router's bound (>= 1)")
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny ViT, not DeiT-Tiny")
    args = parser.parse_args(argv)
    os.environ["RAY_AUTH_MODE"] = "disabled"  # before ray is imported: loopback only, one machine
    os.environ["RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING"] = "0"  # this driver's handles too
    import ray
    from click.testing import CliRunner
    from ray.serve.scripts import cli as serve_cli

    real = DEIT_TINY.is_file() and not args.tiny
    names, ranks = zipf_trace(args.adapters, args.warmup + args.rounds * args.per_round, args.s, args.seed)
    trace = [names[r] for r in ranks]
    image = _png()
    results: dict[str, list[Round]] = {app: [] for app in APPS}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        weights = DEIT_TINY if real else _tiny_weights(tmp / "base.safetensors")
        engine = deit_tiny_engine() if real else MemoryViT.from_timm(weights=str(weights))
        (tmp / "store").mkdir()
        filled = fill_local(LocalStore(tmp / "store"), bundles(engine, args.adapters, m=1, classes=10))
        env = {
            "MEMVIT_WEIGHTS": str(weights),
            "MEMVIT_ADAPTER_STORE": str(tmp / "store"),
            "MEMVIT_RESIDENT_ADAPTERS": str(args.resident),
            "MEMVIT_MAX_TASKS_PER_REQUEST": str(min(64, args.resident)),
            "MEMVIT_MAX_WAIT_MS": "5",
            "MEMVIT_LOG_LEVEL": "warning",
            "MEMVIT_ADMIN_TOKEN": "bench",
            "MEMVIT_STORE_POLL_SECONDS": "2",
        }
        temp_dir = node_temp_dir()
        nodes: list[RayNode] = []
        try:
            # Every request enters through the head's proxy (as a load balancer would spread them over
            # every node's proxy): without this, Serve would keep unkeyed ones on the head's replica.
            # PYTHONPATH: the proxy imports the "random" application's router from benchmarks/.
            node_env = dict(
                [CALLBACK], RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING="0", PYTHONPATH=str(REPO_ROOT)
            )
            nodes.append(RayNode("127.0.0.2", temp_dir, num_cpus=1, resources=SLOTS, env=node_env).start())
            nodes.append(
                RayNode(
                    "127.0.0.3", temp_dir, head=nodes[0], num_cpus=1, resources=SLOTS, env=node_env
                ).start()
            )
            ray.init(address=nodes[0].address, log_to_driver=False, logging_level=logging.WARNING)
            port = free_port()
            config = serve_config(
                tmp / "serve-config.yaml", port, env, cpus=0.3, load_factor=args.load_factor
            )
            result = CliRunner().invoke(serve_cli, ["run", "--non-blocking", str(config)])
            assert result.exit_code == 0, result.output
            wait_running()
            started = time.monotonic()
            for app in APPS:
                run_segment("127.0.0.2", port, app, trace[: args.warmup], image, args.clients)
            warmup_s = time.monotonic() - started
            for i in range(args.rounds):
                segment = trace[args.warmup + i * args.per_round : args.warmup + (i + 1) * args.per_round]
                for app in list(APPS)[:: 1 if i % 2 == 0 else -1]:
                    results[app].append(run_segment("127.0.0.2", port, app, segment, image, args.clients))
                    log.warning("round %d %s: %s", i + 1, app, results[app][-1])
        finally:
            ray.shutdown()
            stop_all(nodes, temp_dir)
    report(results, args, real, filled, warmup_s)


def _tiny_weights(path: Path) -> Path:
    from tests.factories import TINY, tiny_base

    return save_base(tiny_base().model, path, arch="vit_tiny_patch16_224", model_kwargs=TINY)


def _png() -> bytes:
    """One small image (the server resizes it to the model's input)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (120, 60, 200)).save(buf, format="PNG")
    return buf.getvalue()


def report(results: dict[str, list[Round]], args, real: bool, filled: int, warmup_s: float) -> None:
    model = "DeiT-Tiny (real weights)" if real else "tiny ViT"
    setup = (
        f"{filled} adapters (m=1, 10 classes)",
        f"{args.resident} resident per replica",
        f"Zipf s={args.s}",
        f"{args.clients} clients",
        f"load factor {args.load_factor}",
        f"2 replicas x {len(APPS)} applications",
    )
    print(environment(model, *setup))
    print(f"warm-up: {args.warmup} requests per application ({warmup_s:.0f} s for both)\n")
    print("| round | routing | hit rate | p50 ms | p99 ms | busier replica's share | statuses |")
    print("|--:|---|--:|--:|--:|--:|---|")
    for i in range(args.rounds):
        for app in APPS:
            r = results[app][i]
            print(
                f"| {i + 1} | {app} | {r.hit_rate:.3f} | {r.p50_ms:.1f} | {r.p99_ms:.1f} | {r.busiest:.2f} "
                f"| {r.statuses} |"
            )
    med = statistics.median
    for app in APPS:
        rounds = results[app]
        print(
            f"median {app}: hit rate {med(r.hit_rate for r in rounds):.3f}, "
            f"p50 {med(r.p50_ms for r in rounds):.1f} ms, p99 {med(r.p99_ms for r in rounds):.1f} ms"
        )
    for baseline in BASELINES:
        pairs = list(zip(results["affinity"], results[baseline], strict=True))
        print(
            f"median of per-round ratios, adapter-aware / {baseline}: "
            f"hit rate {med(x.hit_rate / y.hit_rate for x, y in pairs):.3f}, "
            f"miss rate {med((1 - x.hit_rate) / (1 - y.hit_rate) for x, y in pairs):.3f}, "
            f"p50 {med(x.p50_ms / y.p50_ms for x, y in pairs):.3f}, "
            f"p99 {med(x.p99_ms / y.p99_ms for x, y in pairs):.3f}"
        )


if __name__ == "__main__":
    main()
