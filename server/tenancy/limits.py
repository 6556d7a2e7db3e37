"""Per-key limits, enforced: a token bucket of images per second, requests in flight, images per request.

The guard (server/edge/guard.py) admits each request to a route that computes (``Route.metered``)
before a byte of its body is read: a key at its requests-in-flight limit, or whose bucket holds not
even one image's token, gets 429 with ``Retry-After`` at once. What it admits gets a ``Ticket`` (in
the request's state) that holds its in-flight slot until the response is done. Once the route has
counted the request's images, ``Ticket.charge`` takes one token per image (429, with the seconds
until the bucket holds that many) and holds the count to the key's largest request (413: retrying
the same request could never pass, so it is not a 429).

A token bucket of capacity ``burst`` refilled at ``rate`` admits at most ``burst + rate * T`` images
in any window of T seconds, the bound the key's owner can plan on. Tokens are taken when a request is
admitted, whatever it is answered: the limit protects the server's work, which starts there.

The state (tokens, requests in flight) is per key id and lives in this process: with N replicas a key
may use N times its limits (docs/design.md §5). Limits are read from the key's policy at each
request, so a change to the keys file applies within its reload interval; a bucket keeps its tokens
across a change (at most the new capacity).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import RateLimitedError, TooManyImagesError
from ..telemetry.metrics import Metrics
from .policy import Limits, Policy


class TokenBucket:
    """``capacity`` tokens at most, refilled at ``rate`` per second; starts full."""

    def __init__(self, rate: float, capacity: int, now: float) -> None:
        self.rate, self.capacity = rate, capacity
        self.tokens = float(capacity)
        self._stamp = now

    def configure(self, rate: float, capacity: int) -> None:
        self.rate, self.capacity = rate, capacity
        self.tokens = min(self.tokens, capacity)

    def _refill(self, now: float) -> None:
        if now > self._stamp:
            self.tokens = min(self.capacity, self.tokens + (now - self._stamp) * self.rate)
            self._stamp = now

    def wait(self, n: float, now: float) -> float:
        """Seconds until ``n`` tokens are there (0: now); ``n`` must be at most the capacity."""
        self._refill(now)
        return max(0.0, (n - self.tokens) / self.rate)

    def take(self, n: float, now: float) -> float:
        """Take ``n`` tokens and return 0, or take none and return the seconds until there are ``n``."""
        wait = self.wait(n, now)
        if wait == 0:
            self.tokens -= n
        return wait


@dataclass
class Ticket:
    """One admitted request: whose it is (its flow in the fair queue), its weight, its slot."""

    limiter: Limiter
    tenant: str
    policy: Policy
    released: bool = False

    @property
    def weight(self) -> float:
        return self.policy.weight

    def charge(self, images: int) -> None:
        """Counts the request's ``images`` against the key's limits: 413 over its largest request,
        429 when its bucket holds fewer tokens (none are taken then)."""
        self.limiter.charge(self.tenant, self.policy.limits, images)

    async def charge_async(self, images: int) -> None:
        """``charge``, where another process may keep the key's limits (server/frontend/)."""
        self.charge(images)

    def release(self) -> None:
        """The request is done (answered or refused): its in-flight slot goes back."""
        if not self.released:
            self.released = True
            self.limiter.release(self.tenant)


class Limiter:
    """The limits' state of one server, per key id (see the module's doc). The event loop owns it."""

    def __init__(self, metrics: Metrics | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.metrics = metrics
        self._clock = clock
        self._buckets: dict[str, TokenBucket] = {}
        self._in_flight: dict[str, int] = {}

    def in_flight(self, tenant: str) -> int:
        return self._in_flight.get(tenant, 0)

    def admit(self, tenant: str, policy: Policy) -> Ticket:
        """A ticket for one request of ``tenant`` (a key's id), or ``RateLimitedError`` from the
        headers alone: at its in-flight limit, or not even one image's token in its bucket."""
        limits = policy.limits
        held = self._in_flight.get(tenant, 0)
        if limits.requests_in_flight is not None and held >= limits.requests_in_flight:
            # When a slot frees is not known; a second is the header's smallest promise.
            raise self._refused(
                tenant,
                "requests_in_flight",
                f"key {tenant!r} has {held} requests in flight, its limit (requests_in_flight)",
                1.0,
            )
        bucket = self._bucket(tenant, limits)
        if bucket is not None and (wait := bucket.wait(1, self._clock())) > 0:
            raise self._refused(tenant, "images_per_second", self._rate_message(tenant, limits), wait)
        self._in_flight[tenant] = held + 1
        return Ticket(self, tenant, policy)

    async def admit_async(self, tenant: str, policy: Policy) -> Ticket:
        """``admit``, where another process may keep the key's limits (server/frontend/)."""
        return self.admit(tenant, policy)

    def charge(self, tenant: str, limits: Limits, images: int) -> None:
        largest = limits.largest_request
        if largest is not None and images > largest:
            if self.metrics is not None:
                self.metrics.key_limited.labels(tenant, "images_per_request").inc()
            which = "images_per_request" if largest == limits.images_per_request else "burst"
            raise TooManyImagesError(
                f"{images} images in one request; key {tenant!r} may send at most {largest} at once "
                f"(its {which})",
                field="image",
            )
        bucket = self._bucket(tenant, limits)
        if bucket is not None and (wait := bucket.take(images, self._clock())) > 0:
            raise self._refused(tenant, "images_per_second", self._rate_message(tenant, limits, images), wait)

    def release(self, tenant: str) -> None:
        held = self._in_flight.get(tenant, 0) - 1
        if held > 0:
            self._in_flight[tenant] = held
        else:
            self._in_flight.pop(tenant, None)

    def _bucket(self, tenant: str, limits: Limits) -> TokenBucket | None:
        shape = limits.bucket
        if shape is None:
            self._buckets.pop(tenant, None)  # the limit was lifted
            return None
        bucket = self._buckets.get(tenant)
        if bucket is None:
            bucket = self._buckets[tenant] = TokenBucket(*shape, self._clock())
        elif (bucket.rate, bucket.capacity) != shape:
            bucket.configure(*shape)
        return bucket

    def _refused(self, tenant: str, limit: str, message: str, wait: float) -> RateLimitedError:
        if self.metrics is not None:
            self.metrics.key_limited.labels(tenant, limit).inc()
        return RateLimitedError(message, retry_after=wait, limit=limit)

    @staticmethod
    def _rate_message(tenant: str, limits: Limits, images: int = 1) -> str:
        rate, burst = limits.bucket or (0.0, 0)
        asked = f"{images} images" if images != 1 else "an image"
        return (
            f"key {tenant!r} is over its limit of {rate:g} images per second (burst {burst}): no room for "
            f"{asked} now"
        )
