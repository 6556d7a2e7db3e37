"""Stand-ins and counters for measuring a GPU pass's host path on a CPU (benchmarks/host_path.py).

- ``StandInGraphs``: memory_core's ``GraphedPasses`` with the capture run once, eagerly, and the
  replay a no-op (that notes when it was called: the launch), so a pass on this CPU does exactly the
  host work a graphed GPU pass does.
- ``StandInEvent``: an event whose copy has always run (``query()`` is True), counting creations,
  records and ``synchronize()`` calls.
- ``HostCounts``/``counting``: every aten op dispatched (and those on host tensors alone: CPU
  kernels on a GPU's host), and every host sync: ``.item()``-like ops,
  ``.tolist()``, ``nonzero``-like ops, ``synchronize()`` and copies from pageable host memory into
  device tensors (the stand-in's "device" tensors being the graph's static ones and those named).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterator

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from memvit.memory_core.routing.graphs import DevicePass, GraphedPasses
from memvit.memory_core.routing.plan import PassPlan, PlanTensors

SYNCING = {
    "aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.nonzero_static", "aten.unique",
    "aten._unique", "aten._unique2", "aten.unique_consecutive", "aten.unique_dim", "aten.masked_select",
    "aten.is_nonzero", "aten.equal", "aten.allclose", "aten._assert_async",
}  # fmt: skip
COPIES = {"aten.copy_", "aten._to_copy", "aten.copy"}


class StandInEvent:
    """A CUDA event stand-in: every copy it follows has run."""

    created = 0
    synchronized = 0

    def __init__(self) -> None:
        StandInEvent.created += 1

    @classmethod
    def factory(cls) -> Callable[[], StandInEvent]:
        return cls

    def record(self, stream: object = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        StandInEvent.synchronized += 1


class StandInGraphs(GraphedPasses):
    """Graphs whose capture is one eager pass and whose replay does nothing (``replays``: runs the
    pass again over the static inputs into the static outputs, as a real replay would; a test of
    what the host puts in the static inputs)."""

    device_tensors: list[Tensor]

    def __init__(self, *, replays: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.replays = replays
        self.device_tensors = []
        self.launches: list[float] = []  # perf_counter() at each replay (cleared by whoever reads it)

    def _warm_up(self, images, tensors, plan, device_pass) -> None:
        pass  # nothing to compile or plan on the CPU

    def _record(
        self, images: Tensor, tensors: PlanTensors | None, plan: PassPlan | None, device_pass: DevicePass
    ) -> tuple[Callable[[], None], Tensor, Tensor | None]:
        base, adapters = device_pass(images, tensors, plan)
        self.device_tensors += [images, base] + ([] if adapters is None else [adapters])

        def replay() -> None:
            self.launches.append(time.perf_counter())  # where a GPU pass's graph launch would be
            if self.replays:
                again = device_pass(images, tensors, plan)
                base.copy_(again[0])
                if adapters is not None:
                    adapters.copy_(again[1])

        return replay, base, adapters

    def _capture(self, *args, **kwargs):
        graph = super()._capture(*args, **kwargs)
        if graph.plan is not None:
            self.device_tensors.append(graph.plan)
        return graph


class HostCounts(TorchDispatchMode):
    """Aten ops and host syncs dispatched while active."""

    def __init__(self, device_tensors: list[Tensor] = ()) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.host_ops: Counter[str] = Counter()  # ops that touch no (stand-in) device tensor
        self.device_ptrs = {t.untyped_storage().data_ptr() for t in device_tensors}
        self.pinned_ptrs: set[int] = set()
        self.tolist = 0
        self.synchronize = 0
        self.pageable_copies = 0
        self.events_created = 0

    @property
    def aten_ops(self) -> int:
        return sum(self.ops.values())

    @property
    def syncs(self) -> int:
        syncing = sum(n for op, n in self.ops.items() if op in SYNCING)
        return syncing + self.tolist + self.synchronize + self.pageable_copies

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.ops[name] += 1
        tensors = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, Tensor)]
        if not any(t.untyped_storage().data_ptr() in self.device_ptrs for t in tensors):
            # An op on host tensors only: on a GPU's host a CPU kernel, which may wake the intra-op
            # thread pool (16 OpenMP threads on a lent machine) for a few microseconds of work.
            self.host_ops[name] += 1
        if name in COPIES and len(args) >= 2 and all(isinstance(a, Tensor) for a in args[:2]):
            target, source = args[0], args[1]
            into_device = target.untyped_storage().data_ptr() in self.device_ptrs
            from_host = source.untyped_storage().data_ptr() not in self.device_ptrs
            if into_device and from_host and source.untyped_storage().data_ptr() not in self.pinned_ptrs:
                self.pageable_copies += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting(counts: HostCounts, graphs: StandInGraphs) -> Iterator[HostCounts]:
    """Count one pass of an engine using ``graphs``: the stand-in device's tensors are the graphs'
    static ones (and those ``counts`` was given), the pinned buffers those acquired meanwhile."""
    from memvit.memory_core.routing.staging import HostBuffers

    created, synced = StandInEvent.created, StandInEvent.synchronized
    real_tolist = Tensor.tolist
    real_acquire = HostBuffers.acquire

    def acquire(self, n, dtype=torch.int64):
        buffer = real_acquire(self, n, dtype)
        counts.pinned_ptrs.add(buffer.tensor.untyped_storage().data_ptr())
        return buffer

    def tolist(self):
        counts.tolist += 1
        return real_tolist(self)

    def synchronize(*args, **kwargs):
        counts.synchronize += 1

    counts.device_ptrs |= {t.untyped_storage().data_ptr() for t in graphs.device_tensors}
    with contextlib.ExitStack() as stack:
        patch = stack.enter_context(_patched())
        patch(Tensor, "tolist", tolist)
        patch(torch.cuda, "synchronize", synchronize)
        patch(HostBuffers, "acquire", acquire)
        stack.enter_context(counts)
        yield counts
    counts.events_created = StandInEvent.created - created
    counts.synchronize += StandInEvent.synchronized - synced


@contextlib.contextmanager
def _patched() -> Iterator[Callable[[object, str, object], None]]:
    saved: list[tuple[object, str, object]] = []

    def patch(owner: object, name: str, value: object) -> None:
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    try:
        yield patch
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)
