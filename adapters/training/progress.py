"""A run's progress bar: the loss and training accuracy, images/s, and where the time goes.

Each refresh (at most twice a second) shows, over the steps since the last one: images per second,
the share of the time the step waited for its batch (``load``: decoding and augmentation in the
workers, or the cache's reads) and the milliseconds of a step without that wait (``step``: the
device's work as the host sees it). A high ``load`` share says the loader, not the device, sets the
pace: more ``--workers``, or an activation cache. The whole run's figures are logged at the end.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from tqdm import tqdm

log = logging.getLogger(__name__)

LOADER_BOUND = 0.3  # the share of waiting above which the end-of-run line names the loader
WARM_UP = 20  # steps: fewer say nothing about the loader (the workers' start dominates)


@dataclass
class _Window:
    steps: int = 0
    images: int = 0
    waited: float = 0.0
    started: float = 0.0

    def reset(self, now: float) -> None:
        self.steps, self.images, self.waited, self.started = 0, 0, 0.0, now


class Progress:
    """tqdm over the run's steps, with the figures above; ``refresh`` is called when a refresh is due
    (it reads the steps' losses back from the device) and returns the loss and accuracy to show."""

    def __init__(self, total: int, initial: int, desc: str, *, enabled: bool, every: float = 0.5) -> None:
        self.bar = tqdm(
            total=total, initial=initial, desc=desc, unit="step", disable=not enabled, dynamic_ncols=True
        )
        self.enabled, self.every = enabled, every
        now = time.perf_counter()
        self.window, self.run = _Window(started=now), _Window(started=now)

    def advance(self, images: int, waited: float) -> bool:
        """One step of ``images`` done, ``waited`` seconds of it waiting for the batch; True when a
        refresh is due (then call ``show``)."""
        for w in (self.window, self.run):
            w.steps, w.images, w.waited = w.steps + 1, w.images + images, w.waited + waited
        self.bar.update(1)
        return self.enabled and time.perf_counter() - self.window.started >= self.every

    def show(self, loss: float, accuracy: float) -> None:
        now = time.perf_counter()
        w = self.window
        elapsed = max(now - w.started, 1e-9)
        self.bar.set_postfix(
            loss=f"{loss:.3f}",
            acc=f"{accuracy:.3f}",
            img_s=f"{w.images / elapsed:.0f}",
            load=f"{w.waited / elapsed:.0%}",
            step=f"{1e3 * (elapsed - w.waited) / max(1, w.steps):.1f}ms",
            refresh=False,
        )
        self.bar.refresh()
        w.reset(now)

    def summary(self) -> dict[str, float]:
        """The whole run's images/s, waiting share and step milliseconds (this process's steps)."""
        r = self.run
        elapsed = max(time.perf_counter() - r.started, 1e-9)
        return {
            "steps": r.steps,
            "images_per_s": r.images / elapsed,
            "load_share": r.waited / elapsed,
            "step_ms": 1e3 * (elapsed - r.waited) / max(1, r.steps),
        }

    def close(self) -> None:
        self.bar.close()
        s = self.summary()
        if not s["steps"]:
            return
        log.info(
            "%d steps, %.0f images/s; waiting for batches %.0f%% of the time, %.1f ms a step besides",
            s["steps"],
            s["images_per_s"],
            100 * s["load_share"],
            s["step_ms"],
        )
        if s["load_share"] > LOADER_BOUND and s["steps"] >= WARM_UP:
            log.warning(
                "the loader set the pace (%.0f%% of the time waiting for batches): give more --workers, "
                "or train from an activation cache (--cache)",
                100 * s["load_share"],
            )
