"""Processes and threads named for the operating system, so ``top -H``, ``ps -L``, ``py-spy`` and
/proc/<pid>/task/<tid>/comm say which is which (``memvit-model``, ``engine-batcher``, ``link-read-3``).

Python names its threads for itself only (``threading.Thread(name=...)``; 3.11 does not pass the
name to the kernel), so every engine and link thread shows as its process's name, and a GPU host's
benchmark could not tell a busy decode thread from a busy link reader. Linux keeps 15 bytes of a
name; elsewhere naming does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Callable
from typing import Any

PR_SET_NAME = 15


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def set_os_name(name: str) -> None:
    """Name the calling thread (the main thread's name is the process's) as the kernel shows it."""
    libc = _libc()
    if libc is not None:
        with contextlib.suppress(AttributeError, OSError):
            libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def os_named(name: str, target: Callable[..., Any]) -> Callable[..., Any]:
    """``target``, run under ``name`` (``set_os_name``) in the thread that runs it."""

    def run(*args: Any, **kwargs: Any) -> Any:
        set_os_name(name)
        return target(*args, **kwargs)

    return run
