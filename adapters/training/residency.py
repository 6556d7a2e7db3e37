"""Which pages of a memory mapping are in RAM (``mincore``), so read-ahead hints go only where needed.

A cache read from disk needs ``MADV_WILLNEED`` for each batch's rows (``ActivationCache.batch``), but
for a cache already in memory each hint is a wasted system call that walks the row's pages in the
page cache (~12 us a row here, 0.4 ms a batch of 32, on the reader thread that shares the cores with
the step). ``mincore`` answers the same question for ~2 us a row.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap

_libc: ctypes.CDLL | bool | None = False  # False: not looked up yet; None: no mincore here


def _mincore() -> ctypes.CDLL | None:
    global _libc
    if _libc is False:
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name, use_errno=True) if name else None
            _libc = libc if libc is not None and hasattr(libc, "mincore") else None
        except OSError:
            _libc = None
    return _libc  # type: ignore[return-value]


def resident_pages(address: int, length: int) -> bytes | None:
    """One byte per page of [address, address + length) (``address`` page-aligned), bit 0 set where
    the page is in memory; None where ``mincore`` is unavailable or fails."""
    libc = _mincore()
    if libc is None or length <= 0:
        return None
    pages = -(-length // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(length), vec) != 0:
        return None
    return bytes(vec)


def all_resident(address: int, length: int) -> bool:
    """Whether every page of the range is in memory (False when it cannot be told)."""
    pages = resident_pages(address, length)
    return pages is not None and all(b & 1 for b in pages)
