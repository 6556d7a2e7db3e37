"""Per-key limits with several processes, never multiplied by their number.

- model-process: the model process keeps every key's limits (one ``Limiter``, ``Admissions``), and
  an API process asks it to admit, charge and release each metered request of a key that has limits
  (``RemoteLimiter``): one round trip over the link at admission and one at charging, exact
  whatever process a request lands on. A key without limits is admitted in the API process, as
  there is nothing to count. An API process that goes away releases its requests' slots.
- replicas: no process is shared, so each replica enforces its share (``ShareLimiter``): the rate,
  the burst and the requests in flight divided by N, rounded up (a key with ``requests_in_flight: 1``
  on 2 replicas may have 2; a request may carry at most the burst's share of images).
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from dataclasses import dataclass, replace

from ..telemetry.metrics import Metrics
from ..tenancy.limits import Limiter, Ticket
from ..tenancy.policy import Limits, Policy
from .link import current_peer
from .remote import ModelLink


@dataclass
class RemoteTicket(Ticket):
    """A request admitted by the model process: charged and released there."""

    link: ModelLink | None = None
    number: int = -1

    def charge(self, images: int) -> None:
        raise RuntimeError("a remote ticket is charged with charge_async")

    async def charge_async(self, images: int) -> None:
        assert self.link is not None
        await self.link.call("charge", self.number, images)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.link.call_soon("release", self.number)


class RemoteLimiter(Limiter):
    """An API process's limiter: the model process decides for keys with limits."""

    def __init__(self, link: ModelLink, metrics: Metrics | None = None) -> None:
        super().__init__(metrics)
        self.link = link

    async def admit_async(self, tenant: str, policy: Policy) -> Ticket:
        if not policy.limits.to_json():
            return self.admit(tenant, policy)
        number = await self.link.call("admit", tenant, policy)
        return RemoteTicket(self, tenant, policy, link=self.link, number=number)


class Admissions:
    """The model process's side: every API process's admitted requests, by number."""

    def __init__(self, metrics: Metrics) -> None:
        self.limiter = Limiter(metrics)
        self._numbers = itertools.count()
        self._tickets: dict[int, Ticket] = {}
        self._by_peer: dict[int, set[int]] = defaultdict(set)

    async def admit(self, tenant: str, policy: Policy) -> int:
        ticket = self.limiter.admit(tenant, policy)
        number = next(self._numbers)
        self._tickets[number] = ticket
        self._by_peer[current_peer.get()].add(number)
        return number

    async def charge(self, number: int, images: int) -> None:
        ticket = self._tickets.get(number)
        if ticket is not None:
            ticket.charge(images)

    async def release(self, number: int) -> None:
        ticket = self._tickets.pop(number, None)
        if ticket is not None:
            ticket.release()
            self._by_peer[current_peer.get()].discard(number)

    def forget(self, peer: int) -> None:
        """An API process went away: its requests are over."""
        for number in self._by_peer.pop(peer, ()):
            ticket = self._tickets.pop(number, None)
            if ticket is not None:
                ticket.release()


class ShareLimiter(Limiter):
    """A replica's limiter: 1/``shares`` of each key's limits (see the module's doc)."""

    def __init__(self, shares: int, metrics: Metrics | None = None) -> None:
        super().__init__(metrics)
        self.shares = shares
        self._cache: dict[Limits, Limits] = {}

    def _share(self, limits: Limits) -> Limits:
        shared = self._cache.get(limits)
        if shared is None:
            n = self.shares

            def part(value: int | None) -> int | None:
                return None if value is None else max(1, math.ceil(value / n))

            bucket = limits.bucket
            shared = self._cache[limits] = replace(
                limits,
                images_per_second=None if bucket is None else bucket[0] / n,
                burst=None if bucket is None else part(bucket[1]),
                requests_in_flight=part(limits.requests_in_flight),
            )
        return shared

    def admit(self, tenant: str, policy: Policy) -> Ticket:
        ticket = super().admit(tenant, replace(policy, limits=self._share(policy.limits)))
        ticket.policy = policy  # charged through ``charge`` below, which takes the share once
        return ticket

    def charge(self, tenant: str, limits: Limits, images: int) -> None:
        super().charge(tenant, self._share(limits), images)
