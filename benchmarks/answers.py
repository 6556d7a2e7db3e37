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
                out[name] = logits_of(json.loads(body))
        return out

    return asyncio.run(ask())


def logits_of(answer: dict) -> dict[str, list[float]]:
    (result,) = answer["results"]
    return {task: values["logits"] for task, values in result["tasks"].items()}


def check(got: dict[str, list[float]], reference: dict[str, list[float]], tolerance: float) -> str | None:
    """Why ``got`` is not ``reference``'s answer (a short reason, the same for every such answer), or
    None when it is."""
    if got.keys() != reference.keys():
        return "other tasks"
    for task, expected in reference.items():
        values = got[task]
        if len(values) != len(expected):
            return f"{task}: other classes"
        if not all(math.isfinite(v) for v in values):
            return f"{task}: non-finite logits"
        if max(abs(a - b) for a, b in zip(values, expected, strict=True)) > tolerance:
            return f"{task}: logits off"
        ranked = sorted(range(len(expected)), key=expected.__getitem__, reverse=True)
        margin = expected[ranked[0]] - expected[ranked[1]] if len(ranked) > 1 else math.inf
        if margin > tolerance and max(range(len(values)), key=values.__getitem__) != ranked[0]:
            return f"{task}: top-1 differs"
    return None


def reason_of(
    status: int, body: bytes, name: str, refs: dict[str, dict[str, list]] | None, tolerance: float
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
    try:
        why = check(logits_of(json.loads(body)), refs[name], tolerance)
    except (ValueError, KeyError, TypeError) as exc:
        why = f"unreadable answer ({type(exc).__name__})"
    return "200" if why is None else f"200 wrong: {why}"
