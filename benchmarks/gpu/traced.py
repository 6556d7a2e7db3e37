"""Error rows that say where: a measurement whose failure keeps its traceback's last frames.

``StepReport.attempt`` (report.py) turns a failure into the row's ``error``, the exception's last
line: on a lent GPU that was "CUDA error: operation failed due to a previous error during capture"
and nothing else, so which capture, called from where, was left to guess. ``traced(fn)`` is ``fn``
whose failure becomes the same row with a ``where`` beside the error: the innermost frames of its
traceback (the repository's paths relative to it, the libraries' from their package), and what the
exception was raised from, if anything.

    report.attempt(TABLE, what, traced(_row), *args)
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import REPO

FRAMES = 6  # the innermost frames kept: the failing call and the calls that led to it
LIMIT = 900  # characters of ``where`` (a Markdown cell)


def where(exc: BaseException, frames: int = FRAMES) -> str:
    """The last ``frames`` frames of ``exc``'s traceback, outermost first, one "file:line function"
    each; then "raised from" the exception it was raised from or during, in a line."""
    summary = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename != __file__][-frames:]
    text = " > ".join(_frame(f) for f in summary)
    cause = exc.__cause__
    if cause is None and not exc.__suppress_context__:
        cause = exc.__context__  # raised while handling another
    if cause is not None:
        last = traceback.extract_tb(cause.__traceback__)[-1:]
        at = f" at {_frame(last[0])}" if last else ""
        text += f" | raised from {type(cause).__name__}{at}: {str(cause)[:160]}"
    return text[:LIMIT]


def traced(fn: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """``fn``, whose exception becomes a row ``{"error": its last line, "where": where(exc)}``."""

    @functools.wraps(fn)
    def call(*args: Any) -> dict[str, Any]:
        try:
            return fn(*args)
        except Exception as exc:  # the row says what and where; the step goes on with the next
            if isinstance(exc, torch.cuda.OutOfMemoryError):
                torch.cuda.empty_cache()
            detail = traceback.format_exception_only(type(exc), exc)[-1].strip()
            return {"error": detail[:500], "where": where(exc)}

    return call


def _frame(frame: traceback.FrameSummary) -> str:
    return f"{_short(frame.filename)}:{frame.lineno} {frame.name}"


def _short(path: str) -> str:
    """A repository path relative to the repository, a library's from its package on."""
    if path.startswith(str(REPO)):
        return path[len(str(REPO)) :].lstrip("/")
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path
