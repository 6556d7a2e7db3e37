"""What a fused pass returns: the base's logits and each task's, for the images that asked for it.

One shape for every pass. ``adapters[name]`` holds one row per image that asked for ``name`` and
``images[name]`` says which images those are (ascending batch indices, a host tensor). Unrouted,
every image asks for every adapter; routed (``MemoryViT.forward(..., tasks=...)``), each task has the
rows of the images that asked for it, and a task nobody asked for is absent.

A planned pass returns one flat (N, C) logits tensor and a numpy index of where each task's rows are
(memory_core/output/index.py: ``OutputIndex``, a run per task; ``PairIndex``, a routed pass's (image,
task) pairs by image): nothing is cut per task when the pass returns, moving the output to the host
is two copies whatever the number of tasks, and ``adapters``/``images`` are lazy mappings that cut a
task when it is read. A server answers a request from ``answers(lo, hi)``: one
fancy index into the flat logits, no Python per task. Outputs built from per-task tensors (training,
cached activations) hold them as they are (``of_tasks``) and read the same way.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ..sets.adapter_set import AdapterSet
from ..weights.adapter import BASE_TASK
from .index import Answers, OutputIndex, PairIndex


class PlannedOutputs(Protocol):
    """What of a ``routing.plan.PassPlan`` an output reads: where each asked task's rows lie, and the
    batch given (a protocol, so that outputs sit below the plans that build them)."""

    @property
    def index(self) -> OutputIndex | PairIndex: ...

    @property
    def batch(self) -> int: ...


class FusedOutput:
    """Logits of one fused pass, and the adapter set that produced them."""

    __slots__ = ("_base", "_batch", "_cut", "_dense", "adapter_set", "flat", "index")

    def __init__(
        self,
        base: Tensor,
        adapter_set: AdapterSet,
        flat: Tensor | None = None,
        index: OutputIndex | PairIndex | None = None,
        *,
        batch: int | None = None,
        dense: tuple[dict[str, Tensor], dict[str, Tensor]] | None = None,
    ) -> None:
        """``base`` (B', C_0), of which the first ``batch`` rows are the images' (B' > B when a graph
        padded the batch); either ``flat`` (N, C) with its ``index``, or ``dense`` per-task
        (logits, images) dicts in the set's order; neither: the base alone."""
        self._base = base
        self._batch = base.shape[0] if batch is None else batch
        self.adapter_set = adapter_set
        self.flat = flat
        self.index = index
        self._dense = dense
        self._cut: dict[str, Tensor] = {}

    # -- building ------------------------------------------------------------------------------
    @classmethod
    def of_plan(
        cls, base: Tensor, flat: Tensor | None, plan: PlannedOutputs | None, adapter_set: AdapterSet
    ) -> FusedOutput:
        """A planned pass's output: ``base`` (B', C_0) with any bucketing padding, and its adapter
        logits ``flat`` (N, C), each asked task one run of rows (``plan.index``)."""
        if plan is None:
            return cls(base, adapter_set)
        return cls(base, adapter_set, flat, plan.index, batch=plan.batch)

    @classmethod
    def of_tasks(
        cls, base: Tensor, adapters: dict[str, Tensor], images: dict[str, Tensor], adapter_set: AdapterSet
    ) -> FusedOutput:
        """Per-task logits ``adapters[name]`` (n_k, C_k) for the ascending ``images[name]`` (n_k,)."""
        return cls(base, adapter_set, dense=(adapters, images))

    @classmethod
    def every_image(cls, base: Tensor, adapters: dict[str, Tensor], adapter_set: AdapterSet) -> FusedOutput:
        """An unrouted pass's output: every adapter answered every image."""
        # One index tensor shared by every task: slicing then looks it up once, not once per task.
        every = torch.arange(base.shape[0], device=base.device)
        return cls.of_tasks(base, adapters, dict.fromkeys(adapters, every), adapter_set)

    @classmethod
    def cat(cls, parts: list[FusedOutput]) -> FusedOutput:
        """Outputs of consecutive runs of images (a batch run in parts) as one output, in their order.
        Every part must come from the same adapter set."""
        adapter_set = parts[0].adapter_set
        if any(p.adapter_set is not adapter_set for p in parts):
            raise ValueError("the parts of one output must come from the same adapter set")
        if len(parts) == 1:
            return parts[0]
        offsets, start = [], 0
        for part in parts:
            offsets.append(start)
            start += len(part)
        names = [n for n in adapter_set.names if any(n in p.adapters for p in parts)]
        adapters, images = {}, {}
        for name in names:
            present = [(p, at) for p, at in zip(parts, offsets, strict=True) if name in p.adapters]
            adapters[name] = torch.cat([p.adapters[name] for p, _ in present])
            images[name] = torch.cat([p.images[name].cpu() + at for p, at in present])
        return cls.of_tasks(torch.cat([p.base for p in parts]), adapters, images, adapter_set)

    # -- reading -------------------------------------------------------------------------------
    @property
    def base(self) -> Tensor:
        """(B, C_0): the base model's own task, for every image."""
        if self._base.shape[0] != self._batch:
            self._base = self._base[: self._batch]  # cut once, when first read
        return self._base

    @property
    def adapters(self) -> Mapping[str, Tensor]:
        """name -> (n_k, C_k) logits, in the set's order; cut from the flat logits when read."""
        return self._dense[0] if self._dense is not None else _Logits(self)

    @property
    def images(self) -> Mapping[str, Tensor]:
        """name -> (n_k,) long host tensor: the images those rows answer, ascending."""
        return self._dense[1] if self._dense is not None else _Images(self)

    def __len__(self) -> int:
        return self._batch

    def logits(self) -> dict[str, Tensor]:
        """Every task's logits by task name, the base task first."""
        return {BASE_TASK: self.base, **self.adapters}

    def answers(self, lo: int = 0, hi: int | None = None) -> tuple[Tensor | None, Answers]:
        """Images [lo, hi)'s answers: the flat logits (N, C) and, by image then task, each answer's
        row of them (``Answers``): a request's share of a batch is ``flat[answers.row]``."""
        hi = len(self) if hi is None else hi
        flat, index = self._flat_and_index()
        if index is None:
            empty = np.zeros(0, dtype=np.int64)
            return flat, Answers(empty, empty, empty, empty)
        return flat, index.answers(lo, hi)

    def __getitem__(self, rows: slice) -> FusedOutput:
        """The same tasks for a slice of the images (e.g. one request's share of a batch)."""
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError(f"FusedOutput takes a contiguous slice of images, got {rows!r}")
        lo, hi, _ = rows.indices(len(self))
        hi = max(lo, hi)
        if self._dense is None:
            index = None if self.index is None else self.index.window(lo, hi)
            return FusedOutput(self._base[lo:hi], self.adapter_set, self.flat, index)
        return FusedOutput.of_tasks(self.base[lo:hi], *_dense_window(*self._dense, lo, hi), self.adapter_set)

    def to(
        self,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        *,
        non_blocking: bool = False,
    ) -> FusedOutput:
        """The output on ``device`` in ``dtype`` (cast where it is, then copied). ``non_blocking`` from a
        GPU to the host: the copy is queued into pinned memory and the host goes on; it holds the
        values once the device's stream has reached it (wait on an event recorded after this)."""

        def move(t: Tensor) -> Tensor:
            return t.to(dtype).to(device, non_blocking=non_blocking)

        if self._dense is None:  # two copies, whatever the number of tasks
            flat = None if self.flat is None else move(self.flat)
            return FusedOutput(move(self._base), self.adapter_set, flat, self.index, batch=self._batch)
        adapters, images = self._dense
        moved: dict[int, Tensor] = {}  # keeps shared index tensors shared
        for who in images.values():
            if id(who) not in moved:
                moved[id(who)] = who.to(device)
        return FusedOutput.of_tasks(
            move(self.base),
            {name: move(t) for name, t in adapters.items()},
            {name: moved[id(who)] for name, who in images.items()},
            self.adapter_set,
        )

    # -- internals -----------------------------------------------------------------------------
    def _flat_and_index(self) -> tuple[Tensor | None, OutputIndex | PairIndex | None]:
        if self._dense is None:
            return self.flat, self.index
        adapters, images = self._dense  # per-task tensors: padded into one flat tensor, once
        if not adapters:
            return None, None
        names = list(adapters)
        width = max(t.shape[1] for t in adapters.values())
        flat = torch.cat([F.pad(adapters[n], (0, width - adapters[n].shape[1])) for n in names])
        counts = np.array([adapters[n].shape[0] for n in names], dtype=np.int64)
        self.flat = flat
        self.index = OutputIndex(
            tasks=np.array([self.adapter_set.index(n) for n in names], dtype=np.int64),
            starts=np.cumsum(counts) - counts,
            counts=counts,
            classes=np.array([adapters[n].shape[1] for n in names], dtype=np.int64),
            images=np.concatenate([images[n].cpu().numpy() for n in names]).astype(np.int64),
            batch=len(self),
        )
        return self.flat, self.index


class _Tasks(Mapping[str, Tensor]):
    """A planned output's tasks by name, in the set's order; each looked up in the index when read."""

    def __init__(self, out: FusedOutput) -> None:
        self._out = out
        self._index: OutputIndex | PairIndex = out.index  # type: ignore[assignment]

    def _run(self, name: str) -> int:
        index = self._index
        position = self._out.adapter_set._by_name.get(name) if index is not None else None
        t = None if position is None else index.find(position)
        if t is None:
            raise KeyError(name)
        return t

    def __iter__(self) -> Iterator[str]:
        if self._index is None:
            return iter(())
        names = self._out.adapter_set.names
        return (names[p] for p in self._index.tasks.tolist())

    def __len__(self) -> int:
        return 0 if self._index is None else len(self._index)

    def __contains__(self, name: object) -> bool:
        try:
            self._run(name)  # type: ignore[arg-type]
        except (KeyError, TypeError):
            return False
        return True


class _Logits(_Tasks):
    def __getitem__(self, name: str) -> Tensor:
        cut = self._out._cut
        if name not in cut:
            cut[name] = self._index.cut(self._out.flat, self._run(name))
        return cut[name]


class _Images(_Tasks):
    def __getitem__(self, name: str) -> Tensor:
        return torch.from_numpy(self._index.image_run(self._run(name)))


def _dense_window(
    adapters: dict[str, Tensor], images: dict[str, Tensor], lo: int, hi: int
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Per-task tensors of images [lo, hi), renumbered from ``lo``."""
    cuts: dict[int, tuple[int, int, Tensor]] = {}  # per distinct index tensor: one lookup
    kept_adapters, kept_images = {}, {}
    for name, who in images.items():
        if id(who) not in cuts:
            bounds = torch.tensor([lo, hi], device=who.device, dtype=who.dtype)
            first, last = torch.searchsorted(who, bounds).tolist()  # who is ascending
            cuts[id(who)] = (first, last, who[first:last] - lo)
        first, last, kept = cuts[id(who)]
        if last > first:
            kept_adapters[name], kept_images[name] = adapters[name][first:last], kept
    return kept_adapters, kept_images
