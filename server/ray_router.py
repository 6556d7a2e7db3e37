"""Adapter-aware routing for the Ray Serve deployment: a request for adapter X goes to X's replica.

Ray Serve runs this router in every proxy (and in every deployment handle), named by the
deployment's ``request_router_config`` (server/ray_serve.py, docker/ray/serve-config.yaml). The key
is the request's ``multiplexed_model_id``, which the proxy middleware sets from the request's first
adapter (server/ray_affinity.py).

Why not ``@serve.multiplexed``: it keeps its own LRU of "models" per replica
(``max_num_models_per_replica``) and routes by what that cache reports through Serve's controller.
Our replicas already own a resident set with its own budget, eviction and pins
(``MEMVIT_RESIDENT_ADAPTERS``, server/registry/); a second cache would either disagree with it or
have to mirror every load and eviction through the controller. So the placement is computed here
from the key and the set of running replicas, and the replicas report nothing:

- *Rendezvous hashing*: each replica gets a score hash(key, replica id); the key's home is the
  replica with the highest. Every proxy computes the same home with no shared state, each replica's
  resident set serves its own slice of the adapters, and when a replica comes or goes only the keys
  it wins or held move (about 1/N of them).
- *Ranks*: the home first; if it is at ``max_ongoing_requests``, the next replica in score order,
  and so on (Serve probes queue lengths and backs off as it does for its own routers). An overloaded
  home spills its adapter's traffic to the next replica rather than queueing it.
- *No key* (base only, no filter, management) or ``adapter_affinity: false`` in
  ``request_router_kwargs``: Serve's default placement, power of two choices (two random replicas,
  preferring this node's when locality routing is on; the shorter queue wins).

What it does not do: an adapter hot enough to overload one replica is not spread over several
until its home is full (Serve's own multiplexing has the same limit).
"""

from __future__ import annotations

import hashlib
import logging
import random
from typing import Any

from ray.serve.request_router import LocalityMixin, PendingRequest, RequestRouter, RunningReplica

log = logging.getLogger("memvit.ray.router")


class AffinityConfigError(ValueError):
    """``request_router_kwargs`` that the router does not understand."""


def rendezvous_order(key: str, replica_ids: list[str]) -> list[str]:
    """``replica_ids`` from the key's home to its last choice (highest hash(key, id) first)."""

    def score(replica_id: str) -> bytes:
        return hashlib.blake2b(f"{key}\0{replica_id}".encode(), digest_size=8).digest()

    return sorted(replica_ids, key=score, reverse=True)


class AdapterAffinityRouter(LocalityMixin, RequestRouter):
    """Routes a keyed request to its adapter's home replica (then the next ones); others by power
    of two choices."""

    def initialize_state(self, adapter_affinity: bool = True, **unknown: Any) -> None:
        if unknown:
            raise AffinityConfigError(
                f"unknown request_router_kwargs {sorted(unknown)}; this router takes adapter_affinity"
            )
        if not isinstance(adapter_affinity, bool):
            raise AffinityConfigError(f"adapter_affinity must be true or false, got {adapter_affinity!r}")
        self.adapter_affinity = adapter_affinity
        log.info("adapter affinity %s", "on" if adapter_affinity else "off (power of two choices)")

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        key = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if key and getattr(self, "adapter_affinity", True):
            by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
            pending_request.routing_context.should_backoff = True
            return [[by_id[replica_id]] for replica_id in rendezvous_order(key, list(by_id))]
        return self._power_of_two(pending_request)

    def _power_of_two(self, pending_request: PendingRequest | None) -> list[list[RunningReplica]]:
        """Serve's default placement for a request without a key (its PowerOfTwoChoicesRequestRouter)."""
        candidates = list(self.apply_locality_routing(pending_request=pending_request))
        if not candidates:
            return []
        chosen = random.sample(candidates, k=min(2, len(candidates)))
        return [[self._replicas[replica_id] for replica_id in chosen]]
