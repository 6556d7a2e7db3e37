"""What ``GraphedPasses`` (graphs.py) captures beside serving, so that no pass waits for a capture:

- ``for_pending_pools``: the graphs of slot pools grown ahead and not yet published, captured by the
  thread growing them (memory_core/routing/slots.py ``grow_ahead``); its captures drop no older
  generation's graphs and evict none, since other threads still replay those;
- ``first_use_beside``: on a serving thread, a pass whose shape has no graph yet runs eagerly (the
  same work launched op by op: a few milliseconds of launches instead of a capture's warm-up passes,
  device synchronisation and collection) and its capture is scheduled on a thread beside serving.

Each such capture holds the graphs' lock while it records, so a serving pass waits for at most one;
a first-met shape's warm-up passes (two eager passes, most of a capture's time) run outside it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from .plan import PassPlan, PlanTensors
from .staging import HostBuffers

# (images, the plan on the device, the plan) -> base logits, adapter logits: the work a graph holds.
DevicePass = Callable[[Tensor, PlanTensors | None, PassPlan | None], tuple[Tensor, Tensor | None]]


class BesideServing:
    """``GraphedPasses``'s captures beside serving (its lock, graphs and counters: graphs.py)."""

    _lock: threading.Lock
    _local: threading.local
    _graphs: dict
    _generation: int
    _deferred: set[tuple]
    buffers: HostBuffers
    eager_passes: int

    _capture: Callable[..., Any]  # -> graphs.py's _Graph
    _inputs: Callable[..., tuple]
    _warm_up: Callable[..., None]

    @contextmanager
    def for_pending_pools(self) -> Iterator[None]:
        """This thread's passes capture graphs for slot pools grown ahead and not yet published
        (memory_core/routing/slots.py): their captures drop no older generation's graphs and evict
        none (other threads still replay those), and count in ``captures_beside``."""
        self._local.pending = True
        try:
            yield
        finally:
            self._local.pending = False

    def _pending(self) -> bool:
        """Whether this thread captures for pools grown ahead (``for_pending_pools``)."""
        return getattr(self._local, "pending", False)

    @contextmanager
    def first_use_beside(self, schedule: Callable[[Callable[[], None]], None]) -> Iterator[None]:
        """This thread's passes (a server's engine) never wait for a capture: a pass whose shape has no
        graph yet runs eagerly (the same work, launched op by op) and its capture goes to
        ``schedule``, to run on a thread beside serving; later passes of the shape replay it."""
        self._local.later = schedule
        try:
            yield
        finally:
            self._local.later = None

    def _eager(
        self, x: Tensor, plan: PassPlan | None, batch: int, device_pass: DevicePass
    ) -> tuple[Tensor, Tensor | None]:
        """The graph's work launched op by op: the images padded to its batch, the plan sent."""
        images = x
        if x.shape[0] != batch:
            images = x.new_zeros((batch, *x.shape[1:]))
            images[: x.shape[0]] = x
        tensors = None if plan is None else plan.tensors(x.device, self.buffers)
        self.eager_passes += 1
        return device_pass(images, tensors, plan)

    def _defer(self, later, full_key, x, plan, batch, device_pass, embed: Any = None) -> None:
        """Hand ``full_key``'s capture to ``later`` (once): with a copy of the plan (its buffer is
        reused), for the pools it was made on (skipped once they grew) and, for a pass from an
        embedding graph's tokens, that graph (skipped once it is gone)."""
        if full_key in self._deferred:
            return
        self._deferred.add(full_key)
        template = torch.empty((0, *x.shape[1:]), dtype=x.dtype, device=x.device)
        kept = None if plan is None else replace(plan, host=plan.host.copy(), buffer=None)

        def wanted() -> bool:  # (under the lock)
            stale = kept is not None and kept.generation < self._generation
            gone = embed is not None and not any(g is embed for g in self._graphs.values())
            return not (full_key in self._graphs or stale or gone)

        def capture() -> None:
            try:
                with self._lock:
                    if not wanted():
                        return
                    inputs = self._inputs(template, kept, batch, None if embed is None else embed.base)
                # The warm-up passes outside the lock: serving replays meanwhile (what they read of
                # the tokens may change under them: their results are thrown away).
                images, _, tensors = inputs
                self._warm_up(images, tensors, kept, device_pass)
                with self._lock:
                    if wanted():  # (for pools grown ahead: evicting nothing)
                        where = {"pending": self._pending(), "beside": True, "warmed": inputs}
                        self._capture(full_key, template, kept, batch, device_pass, **where)
            finally:  # captured, not wanted, or failed: a later pass of the shape may schedule it again
                with self._lock:
                    self._deferred.discard(full_key)

        later(capture)
