"""One intra-op thread for a batch's small tensor operations on a CPU, on the calling thread alone.

torch runs most CPU operations as an OpenMP parallel region whatever their size (a softmax of an
18x16 table, a resize of two 32x32 pictures): the calling thread wakes the pool's other threads,
waits for them to join, and they then spin for a while before they sleep. On a busy machine each join
waits for a core (an 18x16 softmax measured 7 us with one thread, 0.13-1.3 ms with two on this
machine's two shared cores), and the spinning is the process's CPU either way. A batch's decode,
preprocessing and answers are a dozen such operations; the pass is the model's, and keeps its threads.

``torch.set_num_threads`` cannot narrow one thread: it also stores the count process-wide (threads
that start their first operation later take it) and sets MKL's. OpenMP's own ``omp_set_num_threads``
sets the calling thread's count only (an internal control variable of its data environment), and
torch reads that count (``omp_get_max_threads``) for every region it starts on that thread. So
``narrow()`` sets it to 1 through the libgomp torch loaded, and back to what it was. The
operations used here compute every output element (row, pixel) the same way whatever the threads:
the same bits (tests/server/test_intra_op.py).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def _libgomp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (its own copy: another libgomp would hold other counts), or
    None where torch's backend is not OpenMP or it cannot be found (Linux's /proc only)."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = {line.split()[-1] for line in maps.splitlines() if "libgomp" in line.rsplit("/", 1)[-1]}
    if len(paths) != 1:  # none, or two runtimes: which one torch reads is not known
        return None
    try:
        library = ctypes.CDLL(paths.pop())
        library.omp_set_num_threads.argtypes = [ctypes.c_int]
        return library
    except (OSError, AttributeError):
        return None


_GOMP = _libgomp()
if _GOMP is None:
    log.debug("no OpenMP runtime found: small operations keep torch's threads")


def narrow() -> int:
    """The calling thread's torch operations on one thread from now on (other threads keep theirs),
    until ``widen`` with what this returns: the count before, or 0 where nothing was changed (no
    runtime found, or one thread already). Two calls, not a context manager: a batch makes them twice,
    and a generator's context manager is five Python calls more each time."""
    if _GOMP is None:
        return 0
    before = torch.get_num_threads()  # also torch's per-thread set-up, which would reset the count
    if before == 1:
        return 0
    _GOMP.omp_set_num_threads(1)
    return before


def widen(before: int) -> None:
    """Back to ``before`` threads (``narrow``'s answer; 0: nothing to undo)."""
    if before:
        _GOMP.omp_set_num_threads(before)
