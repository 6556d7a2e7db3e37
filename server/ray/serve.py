"""memvit on Ray Serve: N replicas, each the same FastAPI app (``create_app``: same routes, schemas,
errors and metrics) with its own engine and batcher, behind Ray's HTTP proxy.

    serve run memvit.server.ray.serve:app                 # a local Ray instance, http://127.0.0.1:8000
    serve deploy docker/ray/serve-config.yaml      # a running cluster (docker/ray/README.md)

Settings are the ``MEMVIT_*`` variables of ``memvit serve``, read in each replica: the node's
environment (workers inherit that of ``ray start``) overlaid by the application's
``runtime_env.env_vars``. Replicas share adapters through an object-store registry
(``MEMVIT_ADAPTER_STORE=s3://...``), where every change reaches every replica within two polls.

Routing: a request for an adapter goes to the replica whose resident set serves that adapter
(rendezvous hashing on the adapter's name: server/ray/router.py, with the key read from the request
in the proxy by server/ray/affinity.py), so each replica's resident set holds a slice of the tenants
rather than every replica holding the same hot few. ``adapter_affinity: false`` in the deployment's
``request_router_kwargs`` turns it off.

Readiness: Serve routes to a replica once its first ``check_health`` returns. The app loads its model
in a background task of its lifespan (which Serve runs in the replica), so that first check waits
until the model and the store are loaded: the proxy never sends a request to a replica that would
answer "still loading". Unlike ``memvit serve`` on loopback, adapter management is never opened
without a token here: the replica cannot know where the proxy listens. For the same reason
``MEMVIT_HOST`` says where clients reach the app (the proxy's address, not the replica's): the
loopback default of a local ``serve run`` keeps the Host check on; the cluster configs set 0.0.0.0
(docker/ray/), where the proxies listen on every interface, so the check is off unless
``MEMVIT_ALLOWED_HOSTS`` names the load balancer.

This is the only module that imports ray (the ``ray`` extra); ``memvit.server.http.app`` and torch are
imported in the replica, not where the application is built (the driver, Serve's controller).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from ray import serve
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..settings import Settings
from .handover import HandOverMiddleware

if TYPE_CHECKING:
    from fastapi import FastAPI

    from ..http.state import AppState

REPLICA_HEADER = "x-memvit-replica"
AFFINITY_ROUTER = "memvit.server.ray.router:AdapterAffinityRouter"


@dataclass
class InFlight:
    """HTTP requests this replica holds right now (``describe()`` reports it)."""

    count: int = 0


class ReplicaMiddleware:
    """Names the replica that answered (``X-Memvit-Replica``: which one served a request, for logs
    and for checking that every replica serves a change) and counts the requests it holds."""

    def __init__(self, app: ASGIApp, replica: str, in_flight: InFlight) -> None:
        self.app = app
        self.header = (REPLICA_HEADER.encode(), replica.encode())
        self.in_flight = in_flight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        self.in_flight.count += 1
        try:
            await self.app(scope, receive, send_named)
        finally:
            self.in_flight.count -= 1


def replica_settings() -> Settings:
    """The replica's settings from its environment, or one line naming each bad variable."""
    try:
        return Settings()
    except ValidationError as exc:
        problems = "; ".join(
            f"MEMVIT_{'_'.join(map(str, e['loc'])).upper()}: {e['msg']}" for e in exc.errors()
        )
        raise ValueError(f"invalid settings: {problems}") from None


# Defaults for `serve run memvit.server.ray.serve:app`; a Serve config's `deployments:` entry overrides each.
@serve.deployment(
    name="memvit",
    # Requests one replica holds at once: enough for its batcher to fill fused passes
    # (MEMVIT_MAX_BATCH images), while autoscaling aims lower to keep latency flat.
    max_ongoing_requests=64,
    # Past this many waiting in a proxy, Ray refuses at once: 503 + Retry-After like memvit's own queue.
    max_queued_requests=512,
    backpressure_config={"status_code": 503, "retry_after_s": 1},
    autoscaling_config={"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 16},
    # One fused pass uses every core torch is given: one CPU per replica unless the config says more.
    ray_actor_options={"num_cpus": 1},
    health_check_period_s=5,
    health_check_timeout_s=30,
    # A request for adapter X goes to X's replica (server/ray/router.py, server/ray/affinity.py);
    # request_router_kwargs {"adapter_affinity": False} turns it off (power of two choices).
    request_router_config={
        "request_router_class": AFFINITY_ROUTER,
        "request_router_kwargs": {"adapter_affinity": True},
    },
)
@serve.ingress()
class MemvitDeployment:
    """One replica: settings checked at construction, the app built by ``create_app``, ready when loaded."""

    def __init__(self) -> None:
        from ..http.app import preflight

        self.settings = replica_settings()
        level = self.settings.log_level.upper()
        if logging.getLogger().handlers:
            logging.getLogger().setLevel(level)
        else:
            logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
        # Bad weights path, unreachable bucket, no device: this one line is in the controller's log
        # for each try, and after Serve's retries the deployment is marked failed.
        preflight(self.settings)
        self.replica = serve.get_replica_context().replica_tag
        self.in_flight = InFlight()
        self._app: FastAPI | None = None

    def __serve_build_asgi_app__(self) -> FastAPI:
        from ..http.app import create_app

        app = create_app(self.settings)
        app.add_middleware(HandOverMiddleware)  # a retried request whose body stayed with a dead replica
        app.add_middleware(ReplicaMiddleware, replica=self.replica, in_flight=self.in_flight)
        self._app = app
        return app

    @property
    def _state(self) -> AppState:
        assert self._app is not None, "the ASGI app is built before any health check"
        return self._app.state.memvit

    async def check_health(self) -> None:
        """Serve waits for the first call before routing here: it returns once the model and the
        store are loaded (the app's own /readyz), and raises if loading stopped without a service."""
        state = self._state
        while state.service is None:
            if state.loader is not None and state.loader.done():
                raise RuntimeError("loading the model or the adapter store failed (see the replica's log)")
            await asyncio.sleep(0.05)

    def describe(self) -> dict[str, Any]:
        """Where this replica runs, whether it is loaded, its registry and the adapters resident in it,
        and how many HTTP requests it holds (through a Serve handle, not over HTTP:
        ``handle.describe.remote()``)."""
        import ray

        context = ray.get_runtime_context()
        service = self._state.service
        return {
            "replica": self.replica,
            "actor_name": context.get_actor_name(),
            "node_id": context.get_node_id(),
            "ready": service is not None,
            "in_flight": self.in_flight.count,
            "registry": None
            if service is None
            else {"version": service.registry.version, "adapters": len(service.registry)},
            "resident": list(service.live.current.names) if service is not None else [],
            # Adapters asked for by requests: resident ("hit") or loaded for them ("miss").
            "lookups": dict(service.registry.resident.lookups) if service is not None else {},
        }


app = MemvitDeployment.bind()
