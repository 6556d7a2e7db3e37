"""Where a request's time goes: six stages, timed as the request moves through the server.

    receive   from the request's first byte to its body read and parsed (multipart, OIP JSON)
    decode    its images decoded: on CPU workers, and for JPEGs on the device, in its batch
    queue     from its images queued to its batch starting
    copy      its batch's images copied to the device (pinned memory, a copy stream)
    pass      its batch's fused pass, heads included
    respond   from its logits on the host to the response's first byte (top-k, labels, JSON)

Batch stages (copy, the device decode, pass) are the batch's: every request in it waited that long.
On a GPU they come from CUDA events (server/inference/device_runner.py), so timing them makes nobody wait.
Every request's stages are observed in ``memvit_stage_seconds{stage=...}`` (six label values); with
``MEMVIT_SERVER_TIMING=true`` the response also says them in a ``Server-Timing`` header
(https://www.w3.org/TR/server-timing/), in milliseconds, for one request's view in a browser's
developer tools or ``curl -i``.
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass, field

STAGES = ("receive", "decode", "queue", "copy", "pass", "respond")


@dataclass
class StageTimes:
    """One request's stages, in seconds; ``started`` is when its first byte arrived (perf_counter)."""

    started: float = field(default_factory=time.perf_counter)
    seconds: dict[str, float] = field(default_factory=dict)
    answered: float | None = None  # when its logits reached the host: ``respond`` runs from here

    def add(self, stage: str, seconds: float) -> None:
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; stages are {STAGES}")
        self.seconds[stage] = self.seconds.get(stage, 0.0) + max(seconds, 0.0)

    def received(self) -> None:
        """The body is read and parsed: ``receive`` ends now."""
        self.add("receive", time.perf_counter() - self.started)

    def responding(self) -> None:
        """The response's first byte is going out: ``respond`` ends now (if the request was answered)."""
        if self.answered is not None and "respond" not in self.seconds:
            self.add("respond", time.perf_counter() - self.answered)

    def header(self) -> str:
        """The ``Server-Timing`` value: each timed stage and its milliseconds, in the stages' order."""
        return ", ".join(f"{s};dur={self.seconds[s] * 1000:.2f}" for s in STAGES if s in self.seconds)


# The request being served on this task: set by ``MetricsMiddleware`` for every HTTP request, read
# where a stage ends (the pipeline, the batcher), so that no layer between passes it along.
_CURRENT: ContextVar[StageTimes | None] = ContextVar("memvit_stage_times", default=None)


def current_stages() -> StageTimes | None:
    """This request's stage times, or None outside a request."""
    return _CURRENT.get()


def begin_stages() -> StageTimes:
    """Start timing the request this task serves (its first byte is now)."""
    stages = StageTimes()
    _CURRENT.set(stages)
    return stages
