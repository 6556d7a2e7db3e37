"""Task names in a /classify request: ``?tasks=`` parsed, and checked against an adapter set.

The request's tasks are parsed and checked once, before anything is decoded (``deps.classify_input``);
the pipeline receives the checked list. The batcher looks again, against the snapshot its pass will
use, only because an adapter can be removed while a request waits: a different moment, not the same
check again, and the same error (``unknown_tasks_error``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from memory_core import BASE_TASK, AdapterSet

from .errors import UnknownTaskError


def parse_tasks(tasks: Sequence[str] | None) -> list[str] | None:
    """``?tasks=a,b&tasks=c`` -> ["a", "b", "c"]; nothing (or only blanks) means every task."""
    if not tasks:
        return None
    return [t.strip() for item in tasks for t in item.split(",") if t.strip()] or None


def check_tasks(
    wanted: list[str] | None, adapter_set: AdapterSet, visible: Callable[[str], bool] | None = None
) -> None:
    """Raise ``UnknownTaskError`` naming every asked-for task that ``adapter_set`` cannot answer."""
    if wanted is None:
        return
    unknown = [t for t in wanted if t != BASE_TASK and t not in adapter_set]
    if unknown:
        raise unknown_tasks_error(unknown, adapter_set, visible=visible)


def unknown_tasks_error(
    unknown: list[str], adapter_set: AdapterSet, why: str = "", visible: Callable[[str], bool] | None = None
) -> UnknownTaskError:
    """The 422 for ``unknown`` tasks, naming the ones ``adapter_set`` has (those ``visible`` to the
    caller: a tenant's key is never told another tenant's names); ``why``: how it came about."""
    known = [BASE_TASK, *(n for n in adapter_set.names if visible is None or visible(n))]
    error = UnknownTaskError(f"unknown task(s) {unknown}{why}; this server has {known}", field="tasks")
    error.unknown, error.why = tuple(unknown), why  # for re-wording it for a key (routers/classify.py)
    return error
