"""A batch on the model's device in three stages, each on its own thread, so that the host prepares
one batch while the device runs another and a third is read back.

1. ``decode`` (the decode thread, on the device's *prep* stream): JPEGs decoded on the device with
   their batch (server/inference/device_decode.py); images decoded on the CPU (PNG, WebP, ...) stacked into a
   pinned host buffer and copied. An event marks the batch ready.
2. ``launch`` (the pass thread, on the compute stream): waits for that event on the device (never on
   the host), runs the pass (a CUDA graph replay, memory_core/routing/graphs.py), then the batch's answers
   (server/inference/answers.py: a masked softmax and top-k of every row, copied to pinned host memory).
3. ``collect`` (the collector thread): waits for the batch's last copy and hands the answers over.

On a CPU the same calls run in turn, each when called. A batch that runs out of device memory is
split in halves, down to single images, and each part is run alone; an image that still does not
fit answers 503 with ``Retry-After`` (``DeviceMemoryError``), and the server keeps serving. Stage
times (decode, copy, pass) come from CUDA events on a GPU and never make the host wait.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from memvit.memory_core import AdapterSet, MemoryViT, TaskIndex
from memvit.memory_core.routing.staging import PinnedStaging

from ..errors import DeviceMemoryError, ServiceError
from .answers import Answer, BatchAnswers, Want
from .device_decode import DeviceDecoder, Encoded

log = logging.getLogger(__name__)

Item = Tensor | Encoded  # an image decoded on the CPU (C, H, W), or a JPEG for the device decoder


@dataclass
class _Clock:
    """Stage times of one batch: CUDA events on a GPU (read once it has run), the host's clock on CPU."""

    cuda: bool
    marks: dict[str, tuple] = field(default_factory=dict)

    def start(self, stage: str, stream: torch.cuda.Stream | None = None) -> None:
        self.marks[stage] = (self._now(stream), None)

    def stop(self, stage: str, stream: torch.cuda.Stream | None = None) -> None:
        begun, _ = self.marks[stage]
        self.marks[stage] = (begun, self._now(stream))

    def _now(self, stream: torch.cuda.Stream | None):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def seconds(self) -> dict[str, float]:
        """Each stage's duration (after the batch has run)."""
        done = {stage: (begun, end) for stage, (begun, end) in self.marks.items() if end is not None}
        if not self.cuda:
            return {stage: end - begun for stage, (begun, end) in done.items()}
        return {stage: begun.elapsed_time(end) / 1000 for stage, (begun, end) in done.items()}


@dataclass
class Decoded:
    """A batch's images on the device (queued on the prep stream until ``ready``)."""

    x: Tensor  # (B, C, H, W)
    failed: dict[int, ServiceError]  # image -> why it has no input
    clock: _Clock
    ready: torch.cuda.Event | None


@dataclass
class Launched:
    """A batch whose device work is queued: ``collect`` it."""

    size: int
    parts: list[tuple[int, int, BatchAnswers]]  # [lo, hi) of the batch's images, each part's answers
    failed: dict[int, ServiceError]
    clock: _Clock


@dataclass
class Ran:
    """A batch's answers, on the host."""

    parts: list[tuple[int, int, BatchAnswers]]
    failed: dict[int, ServiceError]
    seconds: dict[str, float]  # stage -> seconds, for the batch

    def cut(self, want: Want, tasks: Sequence[str] | None, version: int, registered: int) -> Answer:
        """Images [lo, hi)'s answer (one request's); raises what answers an image of them that has
        no output (its decoder's 4xx, or running out of device memory)."""
        if self.failed:
            for i in range(want.lo, want.hi):
                if i in self.failed:
                    raise self.failed[i]
        if len(self.parts) == 1 and self.parts[0][0] == 0:  # the batch ran whole
            return self.parts[0][2].cut(want, tasks, version, registered)
        pieces = []
        for lo, hi, answers in self.parts:
            if lo < want.hi and want.lo < hi:  # the part's own image numbers
                piece = Want(max(lo, want.lo) - lo, min(hi, want.hi) - lo, want.top_k, want.logits)
                pieces.append(answers.cut(piece, tasks, version, registered))
        return pieces[0] if len(pieces) == 1 else _joined(pieces)


def _joined(pieces: list[Answer]) -> Answer:
    """The answers of consecutive runs of one request's images (a batch split to fit), as one."""
    first = pieces[0]
    logits = None if first.logits is None else np.concatenate([p.logits for p in pieces])
    return Answer(
        first.tasks,
        first.classes,
        np.concatenate([p.probs for p in pieces]),
        np.concatenate([p.index for p in pieces]),
        logits,
        first.labels,
        first.version,
        first.registered,
    )


@dataclass(frozen=True)
class _Lane:
    """What one decode thread uses: its decoder (None: images arrive decoded) and its prep stream."""

    decoder: DeviceDecoder | None
    prep: torch.cuda.Stream | None


class DeviceRunner:
    """Runs batches on ``engine``'s device; ``decoder`` decodes JPEGs there (None: images arrive
    decoded). ``lanes``: how many threads may decode at once, each with a decoder and a prep stream
    of its own (``decode(items, lane)``); the pass and the answers are one stream's."""

    def __init__(self, engine: MemoryViT, decoder: DeviceDecoder | None = None, *, lanes: int = 1) -> None:
        if lanes < 1:
            raise ValueError(f"lanes must be at least 1, got {lanes}")
        self.engine = engine
        self.decoder = decoder
        self.cuda = engine.device.type == "cuda"
        decoders = [decoder] + [decoder.twin() if decoder is not None else None for _ in range(lanes - 1)]
        self.lanes = [_Lane(d, self._prep_stream(d)) for d in decoders]
        self.staging = PinnedStaging() if self.cuda else None

    def _prep_stream(self, decoder: DeviceDecoder | None) -> torch.cuda.Stream | None:
        if not self.cuda:
            return None
        # the decoder's stream when there is one: its barrier covers the copies too
        return decoder.stream if decoder is not None else torch.cuda.Stream(self.engine.device)

    def run(
        self, items: Sequence[Item], adapter_set: AdapterSet, tasks: list | None, wants: list[Want]
    ) -> Ran:
        """The three stages in turn (tests, and callers that want one batch)."""
        return self.collect(self.launch(self.decode(items), adapter_set, tasks, wants))

    # -- stage 1: the images on the device ---------------------------------------------------------
    def decode(self, items: Sequence[Item], lane: int = 0) -> Decoded:
        """The batch's images on the device, by decode thread ``lane``'s decoder and stream."""
        clock = _Clock(self.cuda)
        failed: dict[int, ServiceError] = {}
        use = self.lanes[lane]
        with torch.inference_mode(), torch.cuda.stream(use.prep) if self.cuda else nullcontext():
            x = self._images(items, failed, clock, use)
            ready = None
            if self.cuda:
                ready = torch.cuda.Event()
                ready.record(use.prep)
        return Decoded(x, failed, clock, ready)

    def _images(
        self, items: Sequence[Item], failed: dict[int, ServiceError], clock: _Clock, use: _Lane
    ) -> Tensor:
        on_cpu = [i for i, item in enumerate(items) if isinstance(item, Tensor)]
        encoded = [i for i, item in enumerate(items) if not isinstance(item, Tensor)]
        if not encoded:  # every image decoded on the CPU: the staged copy is the batch
            return self._copied(list(items), clock, use.prep)
        clock.start("decode", use.prep)
        decoded, refused = use.decoder.decode_batch([items[i] for i in encoded])
        clock.stop("decode", use.prep)
        failed.update({encoded[i]: why for i, why in refused.items()})
        if not on_cpu:
            return decoded
        x = torch.empty(len(items), *decoded.shape[1:], device=self.engine.device)
        x.index_copy_(0, self._index(encoded), decoded)
        x.index_copy_(0, self._index(on_cpu), self._copied([items[i] for i in on_cpu], clock, use.prep))
        return x

    def _index(self, rows: list[int]) -> Tensor:
        """Row numbers on the device, without the host waiting for the device's queued work (a copy
        from pageable memory would wait for the batch before this one)."""
        index = torch.tensor(rows, dtype=torch.long)
        if not self.cuda:
            return index
        return index.pin_memory().to(self.engine.device, non_blocking=True)

    def _copied(self, images: list[Tensor], clock: _Clock, prep: torch.cuda.Stream | None) -> Tensor:
        """CPU-decoded images on the device: through pinned memory, on the prep stream (GPU)."""
        if not self.cuda:
            return torch.stack(images).to(self.engine.device)
        # the staging buffers are shared by the lanes: each is held by one copy at a time (staging.py)
        slot, staged = self.staging.stage((len(images), *images[0].shape), images[0].dtype)
        torch.stack(images, out=staged)
        clock.start("copy", prep)
        target = torch.empty(staged.shape, dtype=staged.dtype, device=self.engine.device)
        self.staging.send(slot, staged, target, stream=prep)
        clock.stop("copy", prep)
        return target

    # -- stage 2: the pass and its answers ----------------------------------------------------------
    def launch(
        self, decoded: Decoded, adapter_set: AdapterSet, tasks: list | None, wants: list[Want]
    ) -> Launched:
        """Queue the pass (``tasks``: per image, or None for every adapter) and the batch's answers
        (``wants``: each request's images and what it wants back); returns at once on a GPU."""
        x, failed, clock = decoded.x, dict(decoded.failed), decoded.clock
        with torch.inference_mode():
            if self.cuda:  # the device waits for the images; the host does not
                compute = torch.cuda.current_stream(self.engine.device)
                compute.wait_event(decoded.ready)
                x.record_stream(compute)  # made on the prep stream: kept until the pass has read it
            captured = self.engine.graph_captures
            outs = self._run(x, adapter_set, tasks, 0, x.shape[0], failed, clock)
            if self.engine.graph_captures != captured:  # a shape warm-up did not cover (warmup.py)
                log.warning("a CUDA graph captured while serving: this batch of %d waited for it", x.shape[0])
            labels = self.engine.labels
            parts = [(lo, hi, BatchAnswers(out, labels, _within(wants, lo, hi))) for lo, hi, out in outs]
        return Launched(x.shape[0], parts, failed, clock)

    def _run(
        self,
        x: Tensor,
        adapter_set: AdapterSet,
        tasks: list | None,
        lo: int,
        hi: int,
        failed: dict[int, ServiceError],
        clock: _Clock,
    ) -> list:
        """Images [lo, hi) through the pass, split in halves while the device runs out of memory."""
        try:
            clock.start("pass")
            out = self.engine(x[lo:hi], adapter_set, tasks=_window(tasks, lo, hi, x.shape[0]))
            clock.stop("pass")
            return [(lo, hi, out)]
        except torch.OutOfMemoryError:
            if self.cuda:
                torch.cuda.empty_cache()
            if hi - lo == 1:
                log.warning("one image does not fit in device memory with the adapters it asks for")
                failed[lo] = DeviceMemoryError(
                    "the device ran out of memory for this request (too many adapters asked at once, or "
                    "resident); retry shortly, or ask for fewer tasks"
                )
                return []
            mid = (lo + hi) // 2
            log.warning("the device ran out of memory for %d images: running them in two halves", hi - lo)
            return self._run(x, adapter_set, tasks, lo, mid, failed, clock) + self._run(
                x, adapter_set, tasks, mid, hi, failed, clock
            )

    # -- stage 3: on the host -----------------------------------------------------------------------
    def collect(self, launched: Launched) -> Ran:
        """Wait for a launched batch's answers (its last copy to the host)."""
        for _, _, answers in launched.parts:
            answers.wait()
        return Ran(launched.parts, launched.failed, launched.clock.seconds())


def _window(tasks: TaskIndex | list | None, lo: int, hi: int, n: int) -> TaskIndex | list | None:
    """Images [lo, hi)'s asks (a batch run in parts)."""
    if tasks is None or (lo == 0 and hi == n):
        return tasks
    if not isinstance(tasks, TaskIndex):
        return tasks[lo:hi]
    first, last = int(tasks.offsets[lo]), int(tasks.offsets[hi])
    return TaskIndex(tasks.offsets[lo : hi + 1] - first, tasks.tasks[first:last], tasks.adapter_set)


def _within(wants: list[Want], lo: int, hi: int) -> list[Want]:
    """The requests' wants on images [lo, hi) of the batch, numbered from lo."""
    if lo == 0 and all(w.hi <= hi for w in wants):
        return wants
    return [
        Want(max(w.lo, lo) - lo, min(w.hi, hi) - lo, w.top_k, w.logits)
        for w in wants
        if w.lo < hi and lo < w.hi
    ]
