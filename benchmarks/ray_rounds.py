"""One round of routed requests against a Ray Serve application, for benchmarks/ray_routing.py: the
test's Serve config, prepared requests replayed by closed-loop clients, each replica's adapter
lookups, and a segment's figures (Round)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from benchmarks.loadgen import BOUNDARY, RawHttpClient, multipart_body
from benchmarks.ray_proxy import CONFIG

# Each application's request_router_config: the shipped router with its kwargs, or another router.
APPS: dict[str, dict] = {
    "affinity": {"request_router_kwargs": {"adapter_affinity": True}},
    "random": {
        "request_router_class": "benchmarks.ray_uniform_router:UniformRandomRouter",
        "request_router_kwargs": {},
    },
    "two-choices": {"request_router_kwargs": {"adapter_affinity": False}},
}


@dataclass
class Round:
    hits: int
    lookups: int
    p50_ms: float
    p99_ms: float
    statuses: dict[int, int]
    busiest: float  # the busier replica's share of the adapters asked for (0.5: even)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else float("nan")


def serve_config(path: Path, port: int, env: dict[str, str], cpus: float, load_factor: float) -> Path:
    """The shipped config as one application per entry of APPS, two replicas each, one per node."""
    shipped = yaml.safe_load(CONFIG.read_text())
    (template,) = shipped["applications"]
    apps = []
    for name, router in APPS.items():
        app = yaml.safe_load(yaml.safe_dump(template))
        app.update(name=name, route_prefix=f"/{name}")
        app["runtime_env"]["env_vars"] = env
        (deployment,) = app["deployments"]
        deployment["autoscaling_config"].update(min_replicas=2, initial_replicas=2, max_replicas=2)
        deployment["ray_actor_options"] = {"num_cpus": cpus, "resources": {f"slot_{name}": 1}}
        routing = deployment["request_router_config"]
        routing.update(yaml.safe_load(yaml.safe_dump(router)))  # a copy: APPS stays as written
        if router["request_router_kwargs"].get("adapter_affinity"):
            routing["request_router_kwargs"]["load_factor"] = load_factor
        apps.append(app)
    config = {**shipped, "proxy_location": "HeadOnly", "applications": apps}
    config["http_options"] = {"host": "127.0.0.2", "port": port}
    path.write_text(yaml.safe_dump(config))
    return path


def request_bytes(host: str, port: int, app: str, adapter: str, image: bytes) -> bytes:
    body = multipart_body(image, "img.png")
    head = (
        f"POST /{app}/classify?top_k=1&tasks={adapter} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def replay(host: str, port: int, requests: list[bytes], clients: int) -> tuple[list[float], Counter]:
    """``requests`` in order, by ``clients`` closed-loop clients; each request's latency and the statuses."""
    latencies: list[float] = []
    statuses: Counter = Counter()
    queue = iter(requests)

    async def client() -> None:
        async with RawHttpClient(host, port) as http:
            for request in queue:
                began = time.perf_counter()
                statuses[await http.send(request)] += 1
                latencies.append(time.perf_counter() - began)

    await asyncio.gather(*(client() for _ in range(clients)))
    return latencies, statuses


def lookups(app: str) -> dict[str, Counter]:
    """Adapters asked for on each replica of ``app``, resident ("hit") or not ("miss")."""
    from ray import serve

    handle = serve.get_deployment_handle("memvit", app_name=app)
    seen: dict[str, Counter] = {}
    try:
        for _ in range(40):
            info = handle.describe.remote().result(timeout_s=60)
            seen[info["replica"]] = Counter(info["lookups"])
            if len(seen) == 2:
                break
    finally:
        handle.shutdown()
    assert len(seen) == 2, f"{app}: found {len(seen)} replicas"
    return seen


def run_segment(host: str, port: int, app: str, names: list[str], image: bytes, clients: int) -> Round:
    before = lookups(app)
    latencies, statuses = asyncio.run(
        replay(host, port, [request_bytes(host, port, app, n, image) for n in names], clients)
    )
    after = lookups(app)
    per_replica = [after[r] - before.get(r, Counter()) for r in after]
    delta = sum(per_replica, Counter())
    asked = [c.total() for c in per_replica]
    p50, p99 = np.percentile(latencies, [50, 99]) * 1000
    return Round(
        delta["hit"], delta.total(), float(p50), float(p99), dict(statuses), max(asked) / max(1, sum(asked))
    )


def wait_running(timeout: float = 240) -> None:
    from ray import serve

    def replicas(app: str) -> int:
        status = serve.status().applications.get(app)
        deployment = status.deployments.get("memvit") if status is not None else None
        return deployment.replica_states.get("RUNNING", 0) if deployment is not None else 0

    deadline = time.monotonic() + timeout
    while not all(replicas(app) == 2 for app in APPS):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the Serve applications did not start: {serve.status()}")
        time.sleep(0.5)
