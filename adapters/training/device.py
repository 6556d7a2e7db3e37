"""Where a run computes and in what precision: ``--device`` and ``--precision``, and moving batches there.

``device``: "auto" is the first CUDA device when there is one, else the CPU; "cuda", "cuda:N" or
"cpu" ask for one (a CUDA device on a machine without one is refused before any data is read).

``precision``: "float32" is exact; "bfloat16" is mixed precision as timm's ``--amp`` and Lightning's
``"bf16-mixed"`` have it, except that the frozen base is held in bfloat16 once, as a bfloat16
engine holds it, rather than cast on every call (mixed_pass.py): its rows run in bfloat16, the
adapters' class-token rows under ``torch.autocast`` (bfloat16 matmuls and attention, float32
reductions and norms), while the adapters' parameters, their gradients and the optimiser stay
float32. A pass that reads the base's activations (an activation cache, and evaluation in
bfloat16: base_pass.py) gets them from the same bfloat16 base and runs the class-token path in
float32 over them, as it reads a bfloat16 cache. Bundles hold float32 tensors
whatever the precision, and load on any device.

Batches reach a CUDA device from page-locked (pinned) host memory, copied without blocking the
host (``to_device``); pinning needs a CUDA device, so on the CPU nothing is pinned. Decoded images
are pinned by the thread that takes them from the loader (``image_loader``), not by a DataLoader
pin-memory thread: see there why.
"""

from __future__ import annotations

import contextlib
import os
import re

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

from memvit.memory_core.stored.cached import CachedBatch

DEVICES = ("auto", "cpu", "cuda", "cuda:N")
PRECISIONS = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_device(name: str) -> None:
    """Raise ValueError unless ``name`` is a device setting (whether the machine has it is ``resolve``'s)."""
    if not isinstance(name, str) or not _DEVICE.fullmatch(name):
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {name!r}")


def check_precision(name: str) -> None:
    if name not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {name!r}")


def resolve_device(name: str) -> torch.device:
    """The torch device for a setting: "auto" is CUDA when present; a CUDA device that is not here is
    refused with what the machine has."""
    check_device(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = 0 if device.index is None else device.index
        if index >= count:
            has = f"{count} CUDA device(s)" if count else "no CUDA device"
            raise ValueError(f"device {name!r} asked for, this machine has {has}: use --device cpu or auto")
        device = torch.device("cuda", index)
    return device


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """The class-token rows' autocast for ``precision`` on ``device`` (a no-op for float32).

    ``cache_enabled=False``: autocast's cache of cast weights cannot outlive a CUDA graph capture
    (the step's graph holds these rows); the weights they read are held in bfloat16 already
    (mixed_pass.py), so nothing is left to cache."""
    check_precision(precision)
    if precision == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=PRECISIONS[precision], cache_enabled=False)


def pinning(device: torch.device) -> bool:
    """Whether batches for ``device`` go through pinned host memory: only for CUDA (pinning needs it)."""
    return device.type == "cuda"


def default_workers(device: torch.device) -> int:
    """Decoding processes when ``workers`` is not set: on a GPU host the decode and augmentation,
    not the device, set the pace unless they run beside it (one core stays with the main process);
    on the CPU they would take cores from the step itself, so none."""
    if device.type != "cuda":
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(8, cores - 1))


def image_loader(
    dataset: Dataset,
    *,
    batch_size: int,
    workers: int,
    sampler: Sampler | None = None,
    prefetch_factor: int | None = None,
) -> DataLoader:
    """Batches of ``dataset`` decoded in ``workers`` processes, left in (shared) pageable memory:
    ``to_device`` pins each batch on the thread that takes it, just before its copy.

    Why not the DataLoader's pin-memory thread: it allocates pinned memory (``cudaHostAlloc``) and
    queries the host allocator's events while the consuming thread may be capturing a CUDA graph,
    and a graph captured in CUDA's default "global" mode (the inference engine's own,
    memory_core/routing/graphs.py, which float32 evaluation replays) is invalidated by such a call
    from any thread: "operation failed due to a previous error during capture" on the first
    evaluation of a run with workers (an H200, the regime's float32 run). Pinned here, no thread of
    a run but the one that runs the passes makes a CUDA call while images load. What it costs: one
    host copy per batch on that thread, while the device works through the step it has queued."""
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=workers,
        pin_memory=False,  # to_device pins (above)
        prefetch_factor=prefetch_factor if workers else None,
    )


def to_device(batch: Tensor | CachedBatch, device: torch.device) -> Tensor | CachedBatch:
    """A batch on ``device``. To CUDA the copy goes from pinned memory (a batch not yet pinned is
    pinned first) and does not block the host: the step queues behind it on the device's stream."""
    if isinstance(batch, CachedBatch):
        layers, logits = _move(batch.layers, device), _move(batch.base_logits, device)
        if layers is batch.layers and logits is batch.base_logits:
            return batch
        return CachedBatch(batch.store, layers, logits)
    return _move(batch, device)


def _move(t: Tensor, device: torch.device) -> Tensor:
    if t.device == device:
        return t
    if pinning(device) and t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=t.is_pinned())


def describe(device: torch.device) -> str:
    """The device in words, for the bundle's ``training`` record and the progress bar."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return "cpu"
