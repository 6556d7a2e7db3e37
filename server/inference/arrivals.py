"""How long a forming batch waits for a request that is not announced: while requests arrive densely,
the next one is probably on its way even when no process has said so yet.

The engine loop waits for *announced* images (decoding in this process, or read off the link by the
model process of a group) up to ``max_wait``. That is enough in one process, where a request is
announced before its images are decoded, but not in a group: an API process announces a request only
once it has read and checked the upload, so the model process sees nothing on its way while the API
processes are still reading the next requests, and a batch left as soon as its queue was empty held
5 images where one process's held 16 at the same load (benchmarks/RESULTS.md §3.14). Every image then
paid the batch's fixed costs (decode call, preprocessing, the answers' softmax and top-k, counting,
one frame per API process) three times as often, which is most of what the group cost above one
process.

The rule: ``ArrivalGap`` keeps an exponentially weighted mean of the time between requests; a batch
whose queue is empty waits for the next request ``linger`` times that mean, when the mean and the
latest gap are shorter than the time left before ``max_wait``, and goes at the first gap longer than
that. So
- a lone request, or the first after a pause, goes at once (the gap it ended was long);
- under load a batch fills with the requests arriving within ``max_wait`` (the TF-Serving / TorchServe
  behaviour, but only while requests do come), and the cost is at most ``max_wait`` of latency,
  the setting's own bound (``MEMVIT_MAX_WAIT_MS``).

It is off by default (``MEMVIT_BATCH_LINGER=0``): the batcher cannot tell a stream of independent
requests from one client sending its next request only once answered, whose gaps look as dense and
whose next request cannot come while its batch waits. Measured (RESULTS §3.14, a group, pass
stubbed): with 16 clients it cut the group's CPU per request by ~6% at the same latency, but one
client's p50 went from 1.6 to 3.2 ms and four clients' from 5.7 to 9.0 ms. The signal that would
tell them apart is the API processes' (requests they are still reading); for a deployment fed by
many independent clients, ``MEMVIT_BATCH_LINGER=2`` is the measured setting.
"""

from __future__ import annotations

WEIGHT = 0.2  # of the latest gap in the mean: about the last five requests
LONGEST = 1.0  # seconds: a gap longer than this counts as this (a pause, not the arrival rate)


class ArrivalGap:
    """The mean time between requests, updated under the engine loop's lock (no lock of its own)."""

    def __init__(self, linger: float) -> None:
        """``linger``: how many mean gaps a batch waits for its next request (0: never)."""
        self.linger = linger
        self.mean = self.latest = LONGEST  # the mean gap, and the latest
        self._last: float | None = None

    def arrived(self, now: float) -> None:
        if self._last is not None:
            self.latest = min(now - self._last, LONGEST)
            self.mean += WEIGHT * (self.latest - self.mean)
        self._last = now

    def wait(self, remaining: float) -> float:
        """How long to wait for the next request, ``remaining`` seconds before the batch must go (0:
        go now: off, no time left, or the mean gap or the latest, a pause, as long as what is left)."""
        if self.linger <= 0 or remaining <= 0 or max(self.mean, self.latest) >= remaining:
            return 0.0
        return min(remaining, self.linger * self.mean)
