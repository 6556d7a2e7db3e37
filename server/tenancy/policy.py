"""What each key may use: its weight in the fair queue and its limits, as the keys file states them.

Every key's entry may carry them, and so may the file's ``anonymous`` and ``admin`` objects (the
caller with no key and the admin token are keys too as far as sharing goes)::

    {"id": "acme", ..., "weight": 2,
     "limits": {"images_per_second": 20, "burst": 40, "requests_in_flight": 8, "images_per_request": 16}}

- ``weight`` (> 0, default 1): the key's share of the fused passes while other keys wait too
  (server/inference/fair_queue.py). Alone, a key gets every pass whatever its weight.
- ``images_per_second`` and ``burst``: a token bucket of ``burst`` images (default: one second's
  worth, at least 1) refilled at that rate; a request takes one token per image.
- ``requests_in_flight``: requests of the key being served at once.
- ``images_per_request``: the most images one request may hold (below the server's own cap).

Nothing set: no limit. Parsed here, without torch, so that ``memvit keys`` stays quick; enforced by
server/tenancy/limits.py.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, fields

LIMIT_FIELDS = ("images_per_second", "burst", "requests_in_flight", "images_per_request")


class PolicyError(ValueError):
    """A weight or a limit is malformed; the message names the field."""


@dataclass(frozen=True)
class Limits:
    images_per_second: float | None = None
    burst: int | None = None  # None: one second's worth of images_per_second
    requests_in_flight: int | None = None
    images_per_request: int | None = None

    @functools.cached_property
    def bucket(self) -> tuple[float, int] | None:
        """(rate, capacity) of the key's token bucket; None without a rate."""
        if self.images_per_second is None:
            return None
        return self.images_per_second, self.burst or max(1, math.ceil(self.images_per_second))

    @functools.cached_property
    def largest_request(self) -> int | None:
        """The most images one request may hold: the per-request cap, and never more than the bucket
        holds (such a request could never be served)."""
        caps = [c for c in (self.images_per_request, self.bucket and self.bucket[1]) if c is not None]
        return min(caps) if caps else None

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass(frozen=True)
class Policy:
    """A key's weight and limits (the defaults: weight 1, no limit)."""

    weight: float = 1.0
    limits: Limits = field(default_factory=Limits)

    def to_json(self) -> dict:
        """Only what differs from the defaults, so that a file without them reads back unchanged."""
        out: dict = {}
        if self.weight != 1.0:
            out["weight"] = self.weight
        if limits := self.limits.to_json():
            out["limits"] = limits
        return out


DEFAULT = Policy()


def parse_policy(entry: dict, where: str) -> Policy:
    """The ``weight`` and ``limits`` fields of a key entry (or of ``anonymous``/``admin``)."""
    weight = entry.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < math.inf:
        raise PolicyError(f"{where}.weight: a number above 0, got {weight!r}")
    raw = entry.get("limits", {})
    if not isinstance(raw, dict):
        raise PolicyError(f"{where}.limits: an object with any of {list(LIMIT_FIELDS)}")
    unknown = set(raw) - set(LIMIT_FIELDS)
    if unknown:
        raise PolicyError(f"{where}.limits: unknown field(s) {sorted(unknown)}; known: {list(LIMIT_FIELDS)}")
    values: dict = {}
    for name in LIMIT_FIELDS:
        value = raw.get(name)
        if value is None:
            continue
        if name == "images_per_second":
            ok = not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value < math.inf
            if not ok:
                raise PolicyError(f"{where}.limits.{name}: a number above 0, got {value!r}")
            values[name] = float(value)
        else:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PolicyError(f"{where}.limits.{name}: a whole number of at least 1, got {value!r}")
            values[name] = value
    if "burst" in values and "images_per_second" not in values:
        raise PolicyError(f"{where}.limits.burst: needs images_per_second (the rate that refills it)")
    return Policy(float(weight), Limits(**values))
