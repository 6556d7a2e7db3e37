"""What Ray Serve's HTTP proxy adds: the same replica behind Ray's proxy against `memvit serve` direct.

    pip install -e '.[ray]' && python -m benchmarks.ray_proxy      # ~4 minutes on 2 CPU cores

One machine, one replica each way, the same weights (real DeiT-Tiny when the shared data has it),
the same 8 adapters in the same local store, the same settings:
- direct: `memvit serve` (uvicorn) on a loopback port;
- Ray: a one-node Ray cluster (`ray start`, 2 CPUs) running docker/ray/serve-config.yaml's deployment
  with one replica of 2 CPUs and the proxy middleware, behind Ray's HTTP proxy.
Only one of them is loaded at a time; rounds alternate direct, Ray, so a slow minute of the host hits
both. Per round and load (1 client: the latency the proxy adds; 32 clients: the throughput it
costs), Ray over direct; medians of the rounds. Clients post the shared real photos
(benchmarks/loadgen.py: closed loop, every task answered).
"""

from __future__ import annotations

import asyncio
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.common import DEIT_TINY, argument_parser, deit_tiny_engine, environment, natural_photos
from benchmarks.loadgen import classify_requests, load
from benchmarks.serve_measures import adapter
from memvit.adapters import bundle_for, save_bundle
from memvit.memory_core import MemoryViT, save_base
from tests.server.launcher import ServerProcess, free_port
from tests.server.ray_cluster import RayNode, node_temp_dir, stop_all

CONFIG = Path(__file__).resolve().parents[1] / "docker" / "ray" / "serve-config.yaml"
CALLBACK = ("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", "memvit.server.ray.proxy:proxy_middlewares")


def ray_config(path: Path, port: int, env: dict[str, str]) -> Path:
    """The shipped config with one replica of 2 CPUs on this machine's loopback."""
    config = yaml.safe_load(CONFIG.read_text())
    config["proxy_location"] = "HeadOnly"
    config["http_options"] = {"host": "127.0.0.2", "port": port}
    (app,) = config["applications"]
    app["runtime_env"]["env_vars"] = env
    (deployment,) = app["deployments"]
    deployment.pop("autoscaling_config", None)
    deployment["num_replicas"] = 1
    deployment["ray_actor_options"] = {"num_cpus": 2}
    path.write_text(yaml.safe_dump(config))
    return path


def wait_running(timeout: float = 300) -> None:
    from ray import serve

    deadline = time.monotonic() + timeout
    while getattr(serve.status().applications.get("memvit"), "status", None) != "RUNNING":
        if time.monotonic() > deadline:
            raise TimeoutError("the Serve application did not start")
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--seconds", type=float, default=12.0, help="per load phase")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    os.environ["RAY_AUTH_MODE"] = "disabled"  # before ray is imported: loopback only, one machine
    import ray
    from click.testing import CliRunner
    from ray.serve.scripts import cli as serve_cli

    images = [p.read_bytes() for p in natural_photos()]
    real = DEIT_TINY.is_file()
    engine = deit_tiny_engine() if real else MemoryViT.from_timm("deit_tiny_patch16_224")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        store = tmp / "store"
        store.mkdir()
        for i in range(8):
            w = adapter(f"task-{i}", engine)
            save_bundle(bundle_for(w, engine), store / f"{w.name}.safetensors")
        weights = (
            DEIT_TINY if real else save_base(engine.base, tmp / "base.safetensors", arch=engine.spec.arch)
        )
        settings = {
            "MEMVIT_WEIGHTS": str(weights),
            "MEMVIT_ADAPTER_STORE": str(store),
            "MEMVIT_MAX_WAIT_MS": "10",
            "MEMVIT_LOG_LEVEL": "warning",
            "MEMVIT_ADMIN_TOKEN": "bench",
            "MEMVIT_STORE_POLL_SECONDS": "2",
        }
        temp_dir = node_temp_dir()
        nodes: list[RayNode] = []
        direct = None
        try:
            head = RayNode("127.0.0.2", temp_dir, num_cpus=2, env=dict([CALLBACK])).start()
            nodes.append(head)
            ray.init(address=head.address, log_to_driver=False, logging_level=logging.WARNING)
            ray_port = free_port()
            config = ray_config(tmp / "serve-config.yaml", ray_port, settings)
            result = CliRunner().invoke(serve_cli, ["run", "--non-blocking", str(config)])
            assert result.exit_code == 0, result.output
            wait_running()
            direct = ServerProcess(weights, store, stderr=None, **settings)
            direct.start(timeout=180)
            targets = {"direct": ("127.0.0.1", direct.port), "ray": ("127.0.0.2", ray_port)}
            requests = {k: classify_requests(h, p, images) for k, (h, p) in targets.items()}
            for name, (host, port) in targets.items():  # warm both
                asyncio.run(load(host, port, requests[name], 8, 4.0))
            rounds = []
            for _ in range(args.rounds):
                row = {}
                for clients in (1, 32):
                    for name, (host, port) in targets.items():
                        row[(name, clients)] = asyncio.run(
                            load(host, port, requests[name], clients, args.seconds)
                        )
                rounds.append(row)
        finally:
            if direct is not None:
                direct.stop()
            ray.shutdown()
            stop_all(nodes, temp_dir)

    print(environment("DeiT-Tiny" + (" (real weights)" if real else ""), "8 adapters", "1 replica each way"))
    print("\n| round | clients | direct images/s | Ray images/s | Ray / direct | direct p50 ms | Ray p50 ms "
          "| statuses direct | statuses Ray |\n|--:|--:|--:|--:|--:|--:|--:|---|---|")  # fmt: skip
    ratios: dict[int, list[float]] = {1: [], 32: []}
    added: list[float] = []
    for i, row in enumerate(rounds, 1):
        for clients in (1, 32):
            d, r = row[("direct", clients)], row[("ray", clients)]
            ratios[clients].append(r.throughput / d.throughput)
            if clients == 1:
                added.append(r.p50_ms - d.p50_ms)
            print(
                f"| {i} | {clients} | {d.throughput:.1f} | {r.throughput:.1f} | {ratios[clients][-1]:.3f} "
                f"| {d.p50_ms:.0f} | {r.p50_ms:.0f} | {dict(sorted(d.statuses.items()))} "
                f"| {dict(sorted(r.statuses.items()))} |"
            )
    print(
        f"\nmedian Ray / direct throughput: {statistics.median(ratios[1]):.3f} at 1 client, "
        f"{statistics.median(ratios[32]):.3f} at 32 clients; the proxy adds "
        f"{statistics.median(added):.1f} ms to the median latency of one client"
    )


if __name__ == "__main__":
    main()
