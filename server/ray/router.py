"""Adapter-aware routing for the Ray Serve deployment: a request for adapter X goes to X's replica.

Ray Serve runs this router in every proxy (and in every deployment handle), named by the
deployment's ``request_router_config`` (server/ray/serve.py, docker/ray/serve-config.yaml). The key
is the request's ``multiplexed_model_id``, which the proxy middleware sets from the request's first
adapter (server/ray/affinity.py).

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
- *Bounded load* (consistent hashing with bounded loads): a replica takes its adapters' requests
  while it holds at most ``load_factor`` (1.25) times its fair share of the requests this router has
  in flight, plus one; past that, the next replica in the key's order takes them (and loads the
  adapter, if it is not resident there). So one hot adapter or an unlucky slice cannot queue up on
  one replica while another idles, and a hot adapter ends up resident on several replicas. Each proxy
  counts its own requests: with several proxies each balances its share.
- *Hot adapters get two homes*: an adapter asked for in at least ``hot_share`` (2%) of the last
  ``HOT_WINDOW`` keyed requests is resident on the replicas anyway (every resident set keeps it), so
  it goes to the less loaded of its first two replicas in the key's order (power of two choices
  between its two homes; the home unless it has more than one request more in flight). Under skewed
  (Zipf) traffic a handful of adapters carry a large part of the load; giving them a choice balances
  the replicas, while the long tail, where the resident sets' slices make the difference, stays on
  one home each.
- *Patience*: for its first ``patience_s`` (1 s, as Serve waits for a multiplexed model's replica)
  a request is offered only to its first replica within the bound. Serve probes a replica's queue
  length with a 0.1 s deadline; a busy replica on a loaded machine misses it, and offering the next
  replica then would scatter the adapters. After that, every replica, in the key's order (a replica
  at ``max_ongoing_requests`` is skipped, a lost one is dropped by Serve).
- *No key* (base only, no filter, management) or ``adapter_affinity: false`` in
  ``request_router_kwargs``: Serve's default placement, power of two choices (two random replicas,
  preferring this node's when locality routing is on; the shorter queue wins).

"""

from __future__ import annotations

import hashlib
import logging
import math
import random
import time
from collections import Counter, OrderedDict, deque
from typing import Any

from ray.serve.request_router import LocalityMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

log = logging.getLogger("memvit.ray.router")


class AffinityConfigError(ValueError):
    """``request_router_kwargs`` that the router does not understand."""


def rendezvous_order(key: str, replica_ids: list[str]) -> list[str]:
    """``replica_ids`` from the key's home to its last choice (highest hash(key, id) first)."""

    def score(replica_id: str) -> bytes:
        return hashlib.blake2b(f"{key}\0{replica_id}".encode(), digest_size=8).digest()

    return sorted(replica_ids, key=score, reverse=True)


def placement(key: str, in_flight: dict[str, int], load_factor: float) -> list[str]:
    """The replicas (``in_flight``: each one's requests in flight) in the order to try for ``key``:
    those within ``load_factor`` times the fair share of one more request first, each group in the
    key's rendezvous order."""
    return _within_bound_first(rendezvous_order(key, list(in_flight)), in_flight, load_factor)


def _within_bound_first(ranked: list[str], in_flight: dict[str, int], load_factor: float) -> list[str]:
    """``ranked`` with the replicas past ``load_factor`` x the fair share moved last (stable)."""
    capacity = math.ceil(load_factor * (sum(in_flight.values()) + 1) / len(in_flight))
    return sorted(ranked, key=lambda replica_id: in_flight[replica_id] + 1 > capacity)


HOT_WINDOW = 2000  # keyed requests a router remembers to tell which adapters are hot


class HotKeys:
    """The keys of the last ``window`` keyed requests; a key is hot while it is at least ``share`` of them."""

    def __init__(self, share: float, window: int = HOT_WINDOW) -> None:
        self.share, self._recent, self._counts = share, deque(maxlen=window), Counter()

    def observe(self, key: str) -> bool:
        """Count ``key`` (one more request for it); whether it is hot now."""
        if len(self._recent) == self._recent.maxlen:
            oldest = self._recent[0]
            self._counts[oldest] -= 1
            if not self._counts[oldest]:
                del self._counts[oldest]
        self._recent.append(key)
        self._counts[key] += 1
        return self.share > 0 and self._counts[key] >= self.share * len(self._recent)


HOT_SLACK = 1  # a hot key leaves its home only when the home has more than this many more in flight


def hot_placement(key: str, in_flight: dict[str, int], load_factor: float) -> list[str]:
    """``placement`` for a hot key: its home, unless the home has more than HOT_SLACK requests in
    flight beyond its second replica in the key's order, which then goes first; then the rest as
    ``placement`` orders them. The slack keeps a request from moving over a count that is only a
    moment old (a completion not yet counted when the client's next request arrives)."""
    ranked = rendezvous_order(key, list(in_flight))  # hashed once for both orders
    home, second = ranked[:2]
    first = second if in_flight[home] > in_flight[second] + HOT_SLACK else home
    rest = _within_bound_first(ranked, in_flight, load_factor)
    return [first, *(replica_id for replica_id in rest if replica_id != first)]


class AdapterAffinityRouter(LocalityMixin, RequestRouter):
    """Routes a keyed request to its adapter's home replica (then the next ones); others by power
    of two choices."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.adapter_affinity, self.load_factor, self.patience_s = True, 1.25, 1.0
        self.hot = HotKeys(0.02)
        self._hot_by_request: OrderedDict[str, bool] = OrderedDict()  # Serve may ask again after a backoff
        self._in_flight: Counter[str] = Counter()  # requests this router has on each replica

    def initialize_state(
        self,
        adapter_affinity: bool = True,
        load_factor: float = 1.25,
        patience_s: float = 1.0,
        hot_share: float = 0.02,
        **unknown: Any,
    ) -> None:
        if unknown:
            raise AffinityConfigError(
                f"unknown request_router_kwargs {sorted(unknown)}; this router takes adapter_affinity, "
                "load_factor, patience_s and hot_share"
            )
        if not isinstance(adapter_affinity, bool):
            raise AffinityConfigError(f"adapter_affinity must be true or false, got {adapter_affinity!r}")
        if isinstance(load_factor, bool) or not isinstance(load_factor, int | float) or load_factor < 1:
            raise AffinityConfigError(f"load_factor must be a number >= 1, got {load_factor!r}")
        if isinstance(patience_s, bool) or not isinstance(patience_s, int | float) or patience_s < 0:
            raise AffinityConfigError(f"patience_s must be a number >= 0, got {patience_s!r}")
        if isinstance(hot_share, bool) or not isinstance(hot_share, int | float) or not 0 <= hot_share <= 1:
            raise AffinityConfigError(f"hot_share must be a number from 0 (off) to 1, got {hot_share!r}")
        self.hot = HotKeys(float(hot_share))
        self.adapter_affinity, self.load_factor = adapter_affinity, float(load_factor)
        self.patience_s = float(patience_s)
        log.info(
            "adapter affinity %s",
            f"on (load factor {load_factor}, hot share {hot_share})"
            if adapter_affinity
            else "off (power of two choices)",
        )

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        key = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if key and self.adapter_affinity and candidate_replicas:
            by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
            in_flight = {replica_id: self._in_flight[replica_id] for replica_id in by_id}
            pending_request.routing_context.should_backoff = True
            hot = self._is_hot(key, pending_request.metadata.internal_request_id) and len(in_flight) > 1
            order = (hot_placement if hot else placement)(key, in_flight, self.load_factor)
            if time.time() - pending_request.created_at < self.patience_s:
                order = order[:1]
            return [[by_id[replica_id]] for replica_id in order]
        return self._power_of_two(pending_request)

    def _is_hot(self, key: str, request_id: str) -> bool:
        """Whether ``key`` is hot, counted once per request however often Serve asks to route it."""
        if request_id not in self._hot_by_request:
            self._hot_by_request[request_id] = self.hot.observe(key)
            if len(self._hot_by_request) > HOT_WINDOW:
                self._hot_by_request.popitem(last=False)
        return self._hot_by_request[request_id]

    def on_send_request(self, replica_id: ReplicaID) -> None:
        """Serve calls this for every request it sends (and ``on_request_completed`` once each)."""
        super().on_send_request(replica_id)
        self._in_flight[replica_id.unique_id] += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._in_flight[replica_id.unique_id] > 0:
            self._in_flight[replica_id.unique_id] -= 1

    def _power_of_two(self, pending_request: PendingRequest | None) -> list[list[RunningReplica]]:
        """Serve's default placement for a request without a key (its PowerOfTwoChoicesRequestRouter)."""
        candidates = list(self.apply_locality_routing(pending_request=pending_request))
        if not candidates:
            return []
        chosen = random.sample(candidates, k=min(2, len(candidates)))
        return [[self._replicas[replica_id] for replica_id in chosen]]
