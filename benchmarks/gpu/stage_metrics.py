"""A served load's request stages, read off the server's own /metrics: the sums, counts and buckets
of the stage, batch, pass and request histograms before and after the load, and over it their means
and the bucket that holds each stage's 99th percentile (a p99 far above the stages' says where)."""

from __future__ import annotations

import math
import re

HISTOGRAMS = ("memvit_stage_seconds_", "memvit_batch_images_", "memvit_fused_pass_seconds_")
_BUCKET = re.compile(r"^(memvit_(?:stage|request|gc)_seconds)_bucket\{(.*)\} (\S+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')
_GRAPHS = re.compile(r'^memvit_cuda_graph_captures\{where="([^"]*)"\} (\S+)$')


def parse_metrics(text: str) -> dict[str, float]:
    """The lines of a /metrics text the load's figures need, by their name and labels."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(HISTOGRAMS) and ("_sum" in line or "_count" in line):
            key, value = line.rsplit(" ", 1)
            sums[key] = float(value)
        elif (m := _GRAPHS.match(line)) is not None:  # server/inference/warmup.py
            sums[f"graphs captured {m.group(1)}"] = float(m.group(2))
        elif line.startswith("memvit_eager_passes "):
            sums["eager passes"] = float(line.rsplit(" ", 1)[1])
        elif (m := _BUCKET.match(line)) is not None:
            labels = dict(_LABEL.findall(m.group(2)))
            if m.group(1) == "memvit_request_seconds" and labels.get("route") != "/classify":
                continue
            who = f"gc{labels['generation']}" if "generation" in labels else labels.get("stage", "request")
            key = f"bucket {who} {labels['le']}"
            sums[key] = sums.get(key, 0.0) + float(m.group(3))  # per process where each reports its own
    return sums


def stage_sums(url: str) -> dict[str, float]:
    """The server's stage, batch, pass and request histograms, from /metrics."""
    import httpx

    return parse_metrics(httpx.get(f"{url}/metrics", timeout=30).text)


def stage_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Mean milliseconds of each request stage, the mean batch and pass, over one load."""

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    out: dict[str, float | None] = {}
    for key in after:
        if key.startswith("memvit_stage_seconds_sum"):
            count = delta(key.replace("_sum", "_count"))
            out[f"{key.split(chr(34))[1]} ms"] = 1e3 * delta(key) / count if count else None
    batches = delta("memvit_batch_images_count")
    if batches:
        out["mean batch"] = delta("memvit_batch_images_sum") / batches
        out["mean pass ms"] = 1e3 * delta("memvit_fused_pass_seconds_sum") / batches
    return out


def _cumulative(before: dict[str, float], after: dict[str, float]) -> dict[str, dict[float, float]]:
    """Per histogram (a stage, ``request``, ``gc2``...), its buckets' counts over the load."""
    counts: dict[str, dict[float, float]] = {}
    for key, value in after.items():
        if key.startswith("bucket "):
            _, who, le = key.split(" ")
            counts.setdefault(who, {})[float(le)] = value - before.get(key, 0.0)
    return counts


def _bound(cumulative: dict[float, float], share: float) -> float | None:
    """The upper bound in ms of the bucket holding ``share`` of the observations (None: none)."""
    total = cumulative.get(math.inf, max(cumulative.values(), default=0.0))
    if total <= 0:
        return None
    return 1e3 * min(le for le, n in cumulative.items() if n >= share * total)


def stage_p99_bounds(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per stage and for the whole request (server-side), the upper bound in ms of the histogram
    bucket that holds the load's 99th percentile (inf: past the last bucket)."""
    bounds = {w: _bound(c, 0.99) for w, c in _cumulative(before, after).items() if not w.startswith("gc")}
    return {w: b for w, b in bounds.items() if b is not None}


def full_collections(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """The full garbage collections during the load, every process's (each holds its process), and
    the bucket bound of the longest (``memvit_gc_seconds``, server/telemetry/gc_pauses.py)."""
    cumulative = _cumulative(before, after).get("gc2", {})
    return {
        "full GCs": cumulative.get(math.inf, 0.0),
        "longest full GC ms (bound)": _bound(cumulative, 1.0) if cumulative else None,
    }


def graph_captures(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The CUDA graphs captured during the load, in a batch's way and beside serving, and the passes
    run eagerly meanwhile (``memvit_cuda_graph_captures``, ``memvit_eager_passes``): the first
    should be 0 (server/inference/warmup.py)."""
    keys = ("graphs captured in a batch's way", "graphs captured beside serving", "eager passes")
    return {key: after[key] - before.get(key, 0.0) for key in keys if key in after}
