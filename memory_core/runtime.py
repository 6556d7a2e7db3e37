"""Process-level tuning for CPU inference.

glibc serves allocations above a (dynamic) threshold with fresh ``mmap`` pages and returns them on
free, so every large activation of a pass page-faults its way into existence again. The fused pass
allocates activations slightly larger than the base pass's, which lands them on the wrong side of
that threshold often enough to cost several percent on small models. Pinning the thresholds high
keeps freed activations in the heap for the next pass, as jemalloc or tcmalloc would (PyTorch's CPU
performance guide recommends either). It is a process-wide setting, so only entry points (the CLI,
the server, benchmarks) call it, never library code on import.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def tune_malloc(threshold: int = 1 << 30) -> bool:
    """Keep allocations under ``threshold`` bytes in glibc's heap. Returns False where not glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, threshold) == 1 and mallopt(_M_TRIM_THRESHOLD, 2 * threshold) == 1
    log.info("glibc malloc thresholds %s", "set" if ok else "not set")
    return ok
