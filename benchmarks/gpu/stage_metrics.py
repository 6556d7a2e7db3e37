"""A served load's request stages, read off the server's own /metrics: the sums and counts of the
stage, batch and pass histograms before and after the load, and their means over it."""

from __future__ import annotations


def stage_sums(url: str) -> dict[str, float]:
    """The server's stage, batch and pass histograms' sums and counts, from /metrics."""
    import httpx

    names = ("memvit_stage_seconds_", "memvit_batch_images_", "memvit_fused_pass_seconds_")
    sums: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(names) and ("_sum" in line or "_count" in line):
            key, value = line.rsplit(" ", 1)
            sums[key] = float(value)
    return sums


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
