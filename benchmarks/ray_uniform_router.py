"""A request router that sends each request to a replica drawn uniformly at random.

The "random routing" baseline of ``benchmarks/ray_routing.py`` beside Serve's default (power of two
choices, which with two replicas picks the shorter queue). Ray's proxy imports it by name, so it
imports nothing but ray: no torch in the proxy process.
"""

from __future__ import annotations

import random

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


class UniformRandomRouter(RequestRouter):
    """One replica per request, uniformly at random, whatever its queue or the request's adapter."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        return [[random.choice(candidate_replicas)]] if candidate_replicas else []
