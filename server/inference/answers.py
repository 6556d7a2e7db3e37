"""A batch's answers, computed for the whole batch at once and cut per request with one fancy index.

A fused pass returns the base's logits (B, C_0) and every asked (image, task)'s logits as rows of one
tensor (N, C), each task's classes padded to C (memory_core/output/fused.py). Answering per request and
per task, in Python, is what cost the CPU (a softmax, a top-k and a ``.tolist()`` per task per
request). Here, on the pass's device, for the batch:

- one table ``L`` (N + B, C') of every row the batch computed, the base's rows last;
- the padded classes of each row masked (``-inf``), then one softmax and one top-k (k = the largest
  any request of the batch asked for) over every row;
- one flag per row: every logit finite;
- copied to the host (into pinned memory on a GPU: the host waits on one event, not on each copy);
  the logits themselves only when some request of the batch asked for them.

A request is then ``rows`` (n images x T tasks) of that table, in the order it asked for its tasks:
``probs[rows]``, ``index[rows]``, ``logits[rows]`` (numpy, on the host), an ``Answer``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch
from torch import Tensor

from memvit.memory_core import BASE_TASK, FusedOutput

from ..errors import NonFiniteOutputError

Labels = tuple[str, ...] | None


@dataclass(frozen=True)
class Answer:
    """One request's answer: its n images' T tasks (in the order asked, each once), from one snapshot.

    ``probs``/``index`` hold each (image, task)'s most probable classes, best first: the first
    ``min(top_k, classes[t])`` of task t's k columns are real. ``logits`` (when asked) hold each
    task's logits in its first ``classes[t]`` columns."""

    tasks: tuple[str, ...]
    classes: np.ndarray  # (T,) int64
    probs: np.ndarray  # (n, T, k) float32 softmax probabilities
    index: np.ndarray  # (n, T, k) int64 class indices
    logits: np.ndarray | None  # (n, T, C) float32
    labels: tuple[Labels, ...]  # (T,) each task's class names, from the snapshot that answered
    version: int  # the snapshot's version: the registry's, when it was built
    registered: int  # adapters registered at that version
    stages: dict[str, float] = field(default_factory=dict)  # seconds: queue, decode, copy, pass

    def __len__(self) -> int:
        return self.probs.shape[0]

    def task_logits(self, t: int) -> np.ndarray:
        """Task t's (n, classes[t]) logits (asked for with ``logits``)."""
        assert self.logits is not None
        return self.logits[:, t, : self.classes[t]]


@dataclass(frozen=True)
class Want:
    """What one request of a batch wants back: its images [lo, hi), and ``top_k``/``logits``."""

    lo: int
    hi: int
    top_k: int
    logits: bool


class BatchAnswers:
    """Every row a pass computed, reduced on its device; ``cut`` gives one request's ``Answer``."""

    def __init__(self, out: FusedOutput, base_labels: Labels, wants: Sequence[Want]) -> None:
        """Queues the device work (on the current stream); the host arrays are valid once the stream
        has run it (``ready``: a CUDA event recorded after the copies, or None on a CPU)."""
        self.adapter_set = out.adapter_set
        self.base_labels = base_labels
        base = out.base
        flat, layout = _LAYOUTS.of(out, base_labels)  # the plan's: worked out once per kept plan
        self.n_rows, self.classes, self.every = layout.n_rows, layout.classes, layout.every
        self.column, self.rows, self.column_classes = layout.column, layout.rows, layout.column_classes
        self._asked = layout.asked  # a request's tasks -> (names, columns, labels, classes)
        width = layout.width
        k = min(max((w.top_k for w in wants), default=0), width)
        cuda = base.device.type == "cuda"
        table = _pad(_float(base), width)
        if flat is not None:
            table = torch.cat([_pad(_float(flat), width), table])
        host: dict[str, Tensor] = {}
        if k > 0:
            masked = table
            if layout.padded:  # some rows padded: their padding masked out (else nothing to mask)
                masked = table.masked_fill(layout.padding(base.device), -torch.inf)
            top = masked.softmax(-1).topk(k, dim=-1)
            host["probs"], host["index"] = top.values, top.indices
        if cuda:
            host["finite"] = torch.isfinite(table).all(-1)
        else:  # numpy's on the host table (``wait``): the same flags, ~7 us against torch's ~20 (18x16)
            self._table = table
        if any(w.logits for w in wants):
            host["logits"] = table
        # On a CPU the tensors are on the host already (``to`` would be one more call each).
        self._host = {name: t.to("cpu", non_blocking=True) for name, t in host.items()} if cuda else host
        self.ready = None
        if cuda:
            self.ready = torch.cuda.Event()
            self.ready.record()
        self.k = k

    def wait(self) -> None:
        """Until the host arrays hold the values (a GPU's copies have run)."""
        if self.ready is not None:
            self.ready.synchronize()
        self._arrays = arrays = {name: t.numpy() for name, t in self._host.items()}
        if "finite" not in arrays:  # a CPU's table, here already
            arrays["finite"] = np.isfinite(self._table.numpy()).all(-1)
        self._all_finite = bool(arrays["finite"].all())  # then no request needs to look

    def cut(self, want: Want, tasks: Sequence[str] | None, version: int, registered: int) -> Answer:
        """Images [lo, hi)'s answer to ``tasks`` (None: the base and every adapter computed for them),
        after ``wait``. Raises ``NonFiniteOutputError`` naming a task that produced a non-finite
        logit (refused at registration; float16 serving could still overflow)."""
        names, columns, labels, classes = self._columns(tasks)
        rows = self.rows[want.lo : want.hi][:, columns]  # (n, T): one index for the whole request
        arrays = self._arrays
        if not self._all_finite:
            finite = arrays["finite"][rows]
            if not finite.all():
                bad = names[int(np.flatnonzero(~finite.all(axis=0))[0])]
                raise NonFiniteOutputError(
                    f"task {bad!r} produced non-finite logits; not answering with null"
                )
        k = min(want.top_k, self.k)
        if k > 0:
            probs, index = arrays["probs"][rows, :k], arrays["index"][rows, :k]
        else:
            n, T = rows.shape
            probs, index = np.empty((n, T, 0), dtype=np.float32), np.empty((n, T, 0), dtype=np.int64)
        logits = arrays["logits"][rows] if want.logits else None
        return Answer(names, classes, probs, index, logits, labels, version, registered)

    def _columns(self, tasks: Sequence[str] | None) -> tuple:
        """A request's tasks (each once; None: every one computed), their columns, labels and class
        counts, worked out once per layout (every batch of that plan) for every request asking the
        same."""
        key = None if tasks is None else tuple(tasks)
        found = self._asked.get(key)
        if found is None:
            names = self.every if key is None else tuple(dict.fromkeys(key))
            columns = np.array([self.column[name] for name in names], dtype=np.int64)
            labels = tuple(
                self.base_labels if name == BASE_TASK else self.adapter_set[name].weights.labels
                for name in names
            )
            found = self._asked[key] = (names, columns, labels, self.column_classes[columns])
        return found


@dataclass(eq=False)
class _Layout:
    """What a batch's table is, apart from its values: each row's classes, each (image, task)'s row,
    the columns a request's tasks read. It is the plan's: every batch of one kept plan (an unfiltered
    batch of one size, ``plan_pass``) has the same, so it is worked out once, not once per batch (a
    few dozen numpy calls, and the padding mask's four tensor operations)."""

    n_rows: int
    classes: np.ndarray  # (N + B,) each row's classes
    every: tuple[str, ...]  # the tasks computed, the base first
    column: dict[str, int]
    rows: np.ndarray  # (B, len(every)) image, task -> row (-1: not computed)
    column_classes: np.ndarray  # (len(every),) a task's classes, any image
    width: int  # the table's: the widest row's classes
    asked: dict = field(default_factory=dict)  # a request's tasks -> (names, columns, labels, classes)
    _mask: Tensor | None = None

    @cached_property
    def padded(self) -> bool:
        """Whether some row has fewer classes than the table's width (then its padding is masked):
        the layout's, read every batch of it."""
        return bool(self.classes.min() < self.width)

    def padding(self, device: torch.device) -> Tensor:
        """(N + B, width) True where a row's column is past its classes: masked before the softmax.
        Made once per layout, on the pass's device (and stream, the batches' after it)."""
        if self._mask is None or self._mask.device != device:
            row_classes = torch.from_numpy(self.classes)
            if device.type == "cuda":  # through pinned memory: a pageable copy would wait for the pass
                row_classes = row_classes.pin_memory().to(device, non_blocking=True)
            self._mask = torch.arange(self.width, device=device) >= row_classes[:, None]
        return self._mask


class _Layouts:
    """The layouts of the plans seen lately, by their output index (held, so its id is not reused)."""

    LIMIT = 64  # kept plans: one per batch size and snapshot; a routed batch's index is its own

    def __init__(self) -> None:
        self._known: dict[int, tuple] = {}

    def of(self, out: FusedOutput, base_labels: Labels) -> tuple[Tensor | None, _Layout]:
        """The batch's flat logits and its layout (the plan's, kept, or worked out now)."""
        index, flat, base = out.index, out.flat, out.base
        if index is not None and flat is not None:
            found = self._known.get(id(index))
            if (found is not None and found[0] is index and found[1] is out.adapter_set
                    and found[2] is base_labels and found[3] == (base.shape, flat.shape)):  # fmt: skip
                return flat, found[4]
        flat, every = out.answers()  # every (image, task) answer's row of ``flat``: numpy, no cutting
        layout = _layout(flat, every, base, out.adapter_set)
        index = out.index
        if index is not None and flat is not None:
            if len(self._known) >= self.LIMIT:
                self._known.clear()
            shapes = (base.shape, flat.shape)
            self._known[id(index)] = (index, out.adapter_set, base_labels, shapes, layout)
        return flat, layout


def _layout(flat: Tensor | None, every, base: Tensor, adapter_set) -> _Layout:
    B = base.shape[0]
    n_rows = 0 if flat is None else flat.shape[0]
    classes = np.ones(n_rows + B, dtype=np.int64)  # padding rows (a bucketed plan's): never read
    classes[every.row] = every.classes
    classes[n_rows:] = base.shape[1]
    # (image, task) -> row, for every task the batch computed (the base's column first): a request's
    # rows are one slice and one index of it. Built with numpy, no Python per answer.
    positions = np.unique(every.task)
    adapters = adapter_set.adapters
    names = (BASE_TASK, *(adapters[p].name for p in positions.tolist()))
    rows = np.full((B, len(names)), -1, dtype=np.int64)
    rows[:, 0] = n_rows + np.arange(B)
    columns = np.searchsorted(positions, every.task) + 1
    rows[every.image, columns] = every.row
    column_classes = np.empty(len(names), dtype=np.int64)
    column_classes[0] = base.shape[1]
    column_classes[columns] = every.classes
    column = {name: c for c, name in enumerate(names)}
    # The widest answer's classes, not the flat output's width: a pass's rows may be wider than any
    # task it answered (classes bucketed for its graph), and columns nobody has would be masked and
    # summed in the softmax, which then rounds a row otherwise than the task's own softmax does.
    width = int(classes.max())
    return _Layout(n_rows, classes, names, column, rows, column_classes, width)


_LAYOUTS = _Layouts()


def _float(t: Tensor) -> Tensor:
    return t if t.dtype == torch.float32 else t.float()


def _pad(t: Tensor, width: int) -> Tensor:
    """``t`` at ``width`` columns: zeros to the right (F.pad's operator for a constant, without its
    checks), or the columns past it cut (a view)."""
    if t.shape[1] == width:
        return t
    return t[:, :width] if t.shape[1] > width else torch.constant_pad_nd(t, (0, width - t.shape[1]))
