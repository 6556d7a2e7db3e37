"""Right answers under load: each image's answer alone, and the check of every answer against it.

A server that races (a decoder writing memory a previous batch's kernels still read: issue 41's
500s) answers wrong under load and right alone. So before a load, every image is sent alone, one
request at a time (a batch of 1), asking for its logits: its reference. Under load every answer is
compared with that image's reference: each task's logits within ``tolerance`` (1e-3 in float32, where
TF32 convolutions and batch shapes move the last bits; 0.06 in bfloat16), and the top-1 class equal
wherever the reference's top-2 margin exceeds the tolerance (below it, a tie may fall either way).
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
from pydantic_core import from_json

from benchmarks.loadgen import BOUNDARY, RawHttpClient, multipart_body

TOLERANCE = {"fp32": 1e-3, "bf16": 0.06, "fp16": 0.06}
QUERY = "top_k=1&logits=true"


def classify_requests(
    host: str, port: int, images: list[bytes], *, token: str | None = None, query: str = QUERY
) -> tuple[list[bytes], list[str]]:
    """One prepared ``POST /classify`` per image (named ``photo-<i>``), and the names."""
    requests, names = [], []
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    for i, data in enumerate(images):
        names.append(f"photo-{i}")
        body = multipart_body(data, names[-1])
        head = (
            f"POST /classify?{query} HTTP/1.1\r\nHost: {host}:{port}\r\n{auth}"
            f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        requests.append(head.encode() + body)
    return requests, names


def references(host: str, port: int, requests: list[bytes], names: list[str]) -> dict[str, dict[str, list]]:
    """Each image's answer alone: its requests one at a time, each task's logits."""

    async def ask() -> dict[str, dict[str, list]]:
        out = {}
        async with RawHttpClient(host, port) as http:
            for request, name in zip(requests, names, strict=True):
                status, body = await http.exchange(request)
                if status != 200:
                    raise RuntimeError(f"{name} alone: {status} {body[:300]!r}")
                out[name] = logits_of(from_json(body))
        return out

    return asyncio.run(ask())


def logits_of(answer: dict) -> dict[str, list[float]]:
    (result,) = answer["results"]
    return {task: values["logits"] for task, values in result["tasks"].items()}


@dataclass(frozen=True)
class Expected:
    """One task's reference logits, with what every check of them reads worked out once."""

    logits: np.ndarray  # float64
    top1: int  # the first index of the largest logit
    margin: float  # the largest logit less the second (inf with one class)

    @classmethod
    def of(cls, logits: list[float]) -> Expected:
        x = np.asarray(logits, dtype=np.float64)
        top1 = int(x.argmax()) if x.size else 0
        second = np.delete(x, top1).max() if x.size > 1 else -math.inf
        return cls(x, top1, float(x[top1] - second) if x.size else math.inf)


@dataclass
class Prepared:
    """One image's reference, prepared once for the checks of all its answers under load: each task's
    ``Expected``, and every task's logits end to end, so that a right answer is one array and three
    numpy calls (``holds``), not a dozen per task; a wrong one gets its reason from the tasks."""

    tasks: dict[str, Expected]
    flat: np.ndarray = field(init=False)  # every task's logits, in the tasks' order
    sizes: tuple[int, ...] = field(init=False)
    _close: dict[float, list[tuple[int, int, int]]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.sizes = tuple(e.logits.size for e in self.tasks.values())
        self.flat = np.concatenate([e.logits for e in self.tasks.values()]) if self.tasks else np.zeros(0)

    def holds(self, got: dict[str, list[float]], tolerance: float) -> bool:
        """Whether ``check`` finds nothing wrong: the same tasks and classes, every logit finite and
        within ``tolerance``, the top-1 where the margin asks. Where the reference's top two are more
        than 4 x ``tolerance`` apart, logits within it cannot reorder them (a margin over 2x suffices;
        4x leaves room for rounding), so only the closer tasks have their top-1 compared."""
        if got.keys() != self.tasks.keys():
            return False
        lists = [got[task] for task in self.tasks]
        if not all(type(v) is list for v in lists) or tuple(map(len, lists)) != self.sizes:
            return False
        try:
            values = np.fromiter(chain.from_iterable(lists), dtype=np.float64, count=self.flat.size)
        except (TypeError, ValueError):  # a null or a string among them: check says which
            return False
        if not np.isfinite(values).all():
            return False
        if values.size and np.abs(values - self.flat).max() > tolerance:
            return False
        return all(int(values[lo:hi].argmax()) == top1 for lo, hi, top1 in self._close_calls(tolerance))

    def _close_calls(self, tolerance: float) -> list[tuple[int, int, int]]:
        """The tasks (their span in ``flat``, and top-1) whose top-1 a tolerance's logits could flip."""
        if tolerance not in self._close:
            ends = np.cumsum((0, *self.sizes)).tolist()
            self._close[tolerance] = [
                (ends[t], ends[t + 1], e.top1)
                for t, e in enumerate(self.tasks.values())
                if tolerance < e.margin <= 4 * tolerance
            ]
        return self._close[tolerance]


Reference = dict[str, list[float]] | dict[str, Expected] | Prepared  # a task's logits, or prepared


def prepared(refs: dict[str, dict[str, list[float]]] | None) -> dict[str, Prepared] | None:
    """Every image's reference prepared once (a load checks each thousands of times)."""
    if refs is None:
        return None
    return {
        name: Prepared({task: Expected.of(v) for task, v in tasks.items()}) for name, tasks in refs.items()
    }


def check(got: dict[str, list[float]], reference: Reference, tolerance: float) -> str | None:
    """Why ``got`` is not ``reference``'s answer (a short reason, the same for every such answer), or
    None when it is. Each task's logits in numpy: under load the check runs for every answer, and in
    Python it cost the load generator more than the request itself (a 1,000-class base: 0.4 ms)."""
    if isinstance(reference, Prepared):
        if reference.holds(got, tolerance):
            return None
        reference = reference.tasks  # what is wrong, task by task
    if got.keys() != reference.keys():
        return "other tasks"
    for task, expected in reference.items():
        if not isinstance(expected, Expected):
            expected = Expected.of(expected)
        values = np.asarray(got[task], dtype=np.float64)
        if values.shape != expected.logits.shape:
            return f"{task}: other classes"
        if not np.isfinite(values).all():
            return f"{task}: non-finite logits"
        if values.size and np.abs(values - expected.logits).max() > tolerance:
            return f"{task}: logits off"
        if expected.margin > tolerance and int(values.argmax()) != expected.top1:
            return f"{task}: top-1 differs"
    return None


def reason_of(
    status: int, body: bytes, name: str, refs: dict[str, Reference] | None, tolerance: float
) -> str:
    """ "200" for a right answer; else what was wrong, as a short key to count answers by."""
    if status != 200:
        try:
            error = json.loads(body)["error"]
            kind = error["type"] if isinstance(error, dict) else "error"
            message = error["message"] if isinstance(error, dict) else str(error)
        except (ValueError, KeyError, TypeError):
            kind, message = "unparsed", body[:80].decode("utf-8", "replace")
        return f"{status} {kind}: {message[:100]}"
    if refs is None:
        return "200"
    try:  # pydantic's parser (Rust): a 1,000-class answer's logits in a fifth of json.loads' time
        why = check(logits_of(from_json(body)), refs[name], tolerance)
    except (ValueError, KeyError, TypeError) as exc:
        why = f"unreadable answer ({type(exc).__name__})"
    return "200" if why is None else f"200 wrong: {why}"
