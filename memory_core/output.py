"""What a fused pass returns: the base's logits and each task's, for the images that asked for it.

One shape for every pass. ``adapters[name]`` holds one row per image that asked for ``name`` and
``images[name]`` says which images those are (ascending batch indices). Unrouted, every image asks
for every adapter, so every task's rows are the whole batch; routed (``MemoryViT.forward(...,
tasks=...)``), each task has the rows of the images that asked for it, and a task nobody asked for
is absent. The ``images`` index tensors are host (CPU) tensors: the plan made them on the host, and
cutting an output per request reads them there without waiting for the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .adapter import BASE_TASK
from .adapter_set import AdapterSet

if TYPE_CHECKING:
    from .plan import PassPlan


@dataclass(frozen=True)
class FusedOutput:
    """Logits of one fused pass, and the adapter set that produced them."""

    base: Tensor  # (B, C_0): the base model's own task, for every image
    adapters: dict[str, Tensor]  # name -> (n_k, C_k), in the set's order
    images: dict[str, Tensor]  # name -> (n_k,) long on the host: the images those rows answer, ascending
    adapter_set: AdapterSet  # the snapshot that answered
    # When one pass computed every task's logits into one (rows, classes) tensor (memory_core/plan.py),
    # that tensor and each task's (start, stop, classes) in it: ``to`` then moves one tensor, not K.
    flat: Tensor | None = None
    spans: dict[str, tuple[int, int, int]] | None = None

    @classmethod
    def of_plan(
        cls, base: Tensor, flat: Tensor | None, plan: PassPlan | None, adapter_set: AdapterSet
    ) -> FusedOutput:
        """A planned pass's output: ``base`` (B, C_0) with any bucketing padding, and its adapter
        logits ``flat`` (N, C), each asked task one run of rows (``plan.tasks``), cut out as views."""
        if plan is None:
            return cls(base, {}, {}, adapter_set)
        spans = {t.name: (t.start, t.stop, t.classes) for t in plan.tasks}
        images = {t.name: t.images for t in plan.tasks}
        return cls(base[: plan.batch], _cut(flat, spans), images, adapter_set, flat, spans)

    @classmethod
    def every_image(cls, base: Tensor, adapters: dict[str, Tensor], adapter_set: AdapterSet) -> FusedOutput:
        """An unrouted pass's output: every adapter answered every image."""
        # One index tensor shared by every task: slicing then looks it up once, not once per task.
        every = torch.arange(base.shape[0], device=base.device)
        return cls(base, adapters, dict.fromkeys(adapters, every), adapter_set)

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
        return cls(torch.cat([p.base for p in parts]), adapters, images, adapter_set)

    def __len__(self) -> int:
        return self.base.shape[0]

    def __getitem__(self, rows: slice) -> FusedOutput:
        """The same tasks for a slice of the images (e.g. one request's share of a batch)."""
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError(f"FusedOutput takes a contiguous slice of images, got {rows!r}")
        start, stop, _ = rows.indices(len(self))
        # Per distinct index tensor: (first row, end row, indices renumbered from the slice's start).
        # Unrouted, all tasks share one, so a batch of 1,000 tasks is cut with one lookup.
        cuts: dict[int, tuple[int, int, Tensor]] = {}
        adapters, images = {}, {}
        for name, who in self.images.items():
            if id(who) not in cuts:
                bounds = torch.tensor([start, stop], device=who.device, dtype=who.dtype)
                lo, hi = torch.searchsorted(who, bounds).tolist()  # who is ascending
                cuts[id(who)] = (lo, hi, who[lo:hi] - start)
            lo, hi, kept = cuts[id(who)]
            if hi > lo:
                adapters[name], images[name] = self.adapters[name][lo:hi], kept
        return FusedOutput(self.base[rows], adapters, images, self.adapter_set)

    def logits(self) -> dict[str, Tensor]:
        """Every task's logits by task name, the base task first."""
        return {BASE_TASK: self.base, **self.adapters}

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

        moved: dict[int, Tensor] = {}  # keeps shared index tensors shared (see __getitem__)
        for who in self.images.values():
            if id(who) not in moved:
                moved[id(who)] = who.to(device)
        images = {name: moved[id(who)] for name, who in self.images.items()}
        base = move(self.base)
        if self.flat is not None and self.spans is not None:  # one copy for every task
            flat = move(self.flat)
            return FusedOutput(base, _cut(flat, self.spans), images, self.adapter_set, flat, self.spans)
        adapters = {name: move(t) for name, t in self.adapters.items()}
        return FusedOutput(base, adapters, images, self.adapter_set)


def _cut(flat: Tensor, spans: dict[str, tuple[int, int, int]]) -> dict[str, Tensor]:
    """Each task's rows and classes of ``flat``: views, no copies."""
    return {name: flat[start:stop, :classes] for name, (start, stop, classes) in spans.items()}
