"""A batch on the model's device: staged, decoded, run and read back without the host waiting.

On a GPU the host prepares and collects a batch; the device runs it. ``launch`` (the inference
thread) queues all of a batch's device work and returns at once:
- images decoded on the CPU (PNG, WebP, ...) are stacked into a pinned host buffer and copied on a
  copy stream, so the copy overlaps the previous batch's pass;
- JPEGs go to the device decoder in one call (server/device_decode.py);
- the pass (a CUDA graph replay, memory_core/graphs.py) follows them on the compute stream;
- its logits are cast to float32 and copied into pinned host memory, and an event marks the end.
``collect`` (another thread) waits for that event and hands the output over, so the batcher
launches the next batch while this one computes. On a CPU the same calls simply run in turn.

A batch that runs out of device memory is split in halves, down to single images, and each part is
run alone; an image that still does not fit answers 503 with ``Retry-After`` (``DeviceMemoryError``),
and the server keeps serving. Stage times (copy, decode, pass) come from CUDA events on a GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from memvit.memory_core import AdapterSet, FusedOutput, MemoryViT
from memvit.memory_core.staging import PinnedStaging

from .device_decode import DeviceDecoder, Encoded
from .errors import DeviceMemoryError, ServiceError

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
class Launched:
    """A batch whose device work is queued: ``collect`` it."""

    size: int
    parts: list[tuple[int, int, FusedOutput]]  # [lo, hi) of the batch's images, on the host (pending)
    failed: dict[int, ServiceError]  # image -> why it has no answer
    done: torch.cuda.Event | None  # recorded after the last copy to the host
    clock: _Clock


@dataclass
class Ran:
    """A batch's answers, on the host."""

    parts: list[tuple[int, int, FusedOutput]]
    failed: dict[int, ServiceError]
    seconds: dict[str, float]  # stage -> seconds, for the batch

    def slice(self, start: int, stop: int) -> FusedOutput:
        """The output of images [start, stop) (one request's); raises what answers an image of them
        that has no output (its decoder's 4xx, or running out of device memory)."""
        for i in range(start, stop):
            if i in self.failed:
                raise self.failed[i]
        pieces = [
            out[max(lo, start) - lo : min(hi, stop) - lo]
            for lo, hi, out in self.parts
            if lo < stop and start < hi
        ]
        return FusedOutput.cat(pieces)


class DeviceRunner:
    """Runs batches on ``engine``'s device; ``decoder`` decodes JPEGs there (None: images arrive
    decoded)."""

    def __init__(self, engine: MemoryViT, decoder: DeviceDecoder | None = None) -> None:
        self.engine = engine
        self.decoder = decoder
        self.cuda = engine.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(engine.device) if self.cuda else None
        self.staging = PinnedStaging() if self.cuda else None

    def launch(self, items: Sequence[Item], adapter_set: AdapterSet, tasks: list | None) -> Launched:
        """Queue one batch (``tasks``: per image, or None for every adapter) and return at once."""
        clock = _Clock(self.cuda)
        failed: dict[int, ServiceError] = {}
        with torch.inference_mode():
            x = self._images(items, failed, clock)
            parts = self._run(x, adapter_set, tasks, 0, len(items), failed, clock)
            done = None
            if self.cuda:
                done = torch.cuda.Event()
                done.record()
        return Launched(len(items), parts, failed, done, clock)

    def collect(self, launched: Launched) -> Ran:
        """Wait for a launched batch and return its answers."""
        if launched.done is not None:
            launched.done.synchronize()
        return Ran(launched.parts, launched.failed, launched.clock.seconds())

    def run(self, items: Sequence[Item], adapter_set: AdapterSet, tasks: list | None) -> Ran:
        return self.collect(self.launch(items, adapter_set, tasks))

    # -- the images on the device ------------------------------------------------------------------
    def _images(self, items: Sequence[Item], failed: dict[int, ServiceError], clock: _Clock) -> Tensor:
        device = self.engine.device
        on_cpu = [i for i, item in enumerate(items) if isinstance(item, Tensor)]
        encoded = [i for i, item in enumerate(items) if not isinstance(item, Tensor)]
        if not encoded:  # every image decoded on the CPU: the staged copy is the batch
            return torch.stack(list(items)) if not self.cuda else self._copied(list(items), clock)
        clock.start("decode", self.decoder.stream)
        decoded, refused = self.decoder.decode_batch([items[i] for i in encoded])
        clock.stop("decode", self.decoder.stream)
        if self.cuda:  # read on this stream, made on the decoder's: kept until the pass has read it
            torch.cuda.current_stream(device).wait_stream(self.decoder.stream)
            decoded.record_stream(torch.cuda.current_stream(device))
        failed.update({encoded[i]: why for i, why in refused.items()})
        if not on_cpu:
            return decoded
        x = torch.empty(len(items), *decoded.shape[1:], device=device)
        x.index_copy_(0, self._index(encoded), decoded)
        x.index_copy_(0, self._index(on_cpu), self._copied([items[i] for i in on_cpu], clock))
        return x

    def _index(self, rows: list[int]) -> Tensor:
        """Row numbers on the device, without the host waiting for the device's queued work (a copy
        from pageable memory would wait for the batch before this one)."""
        index = torch.tensor(rows, dtype=torch.long)
        if not self.cuda:
            return index
        return index.pin_memory().to(self.engine.device, non_blocking=True)

    def _copied(self, images: list[Tensor], clock: _Clock) -> Tensor:
        """CPU-decoded images on the device: through pinned memory, on the copy stream (GPU)."""
        if not self.cuda:
            return torch.stack(images).to(self.engine.device)
        slot, staged = self.staging.stage((len(images), *images[0].shape), images[0].dtype)
        torch.stack(images, out=staged)
        clock.start("copy", self.copy_stream)
        with torch.cuda.stream(self.copy_stream):
            target = torch.empty(staged.shape, dtype=staged.dtype, device=self.engine.device)
        self.staging.send(slot, staged, target, stream=self.copy_stream)
        clock.stop("copy", self.copy_stream)
        compute = torch.cuda.current_stream(self.engine.device)
        compute.wait_stream(self.copy_stream)
        target.record_stream(compute)  # allocated on the copy stream, read on the compute stream
        return target

    # -- the pass ----------------------------------------------------------------------------------
    def _run(
        self,
        x: Tensor,
        adapter_set: AdapterSet,
        tasks: list | None,
        lo: int,
        hi: int,
        failed: dict[int, ServiceError],
        clock: _Clock,
    ) -> list[tuple[int, int, FusedOutput]]:
        """Images [lo, hi) through the pass, split in halves while the device runs out of memory."""
        try:
            clock.start("pass")
            out = self.engine(x[lo:hi], adapter_set, tasks=None if tasks is None else tasks[lo:hi])
            clock.stop("pass")
            return [(lo, hi, out.to("cpu", torch.float32, non_blocking=self.cuda))]
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
