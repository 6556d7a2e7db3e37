"""Task names in a /classify request: ``?tasks=`` parsed, and checked against the registry.

The request's tasks are parsed and checked once, before anything is decoded (``deps.classify_input``):
no filter is allowed only while the registry is small enough for one request to compute every
adapter; a filter may name at most ``max_tasks`` adapters, each registered (a name not found sends the
registry to the store once, rate-limited, in case another replica registered it a moment ago). The
batcher looks again, against the snapshot its pass will use, only because an adapter can be deleted
while a request waits: a different moment, not the same check again, and the same error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from memvit.memory_core import BASE_TASK, AdapterSet

from ..errors import TasksRequiredError, TooManyTasksError, UnknownTaskError

if TYPE_CHECKING:
    from ..registry import AdapterRegistry

_NAMES_SHOWN = 20  # an error lists this many known tasks, not 100,000


def parse_tasks(tasks: Sequence[str] | None) -> list[str] | None:
    """``?tasks=a,b&tasks=c`` -> ["a", "b", "c"]; nothing (or only blanks) means every task."""
    if not tasks:
        return None
    return [t.strip() for item in tasks for t in item.split(",") if t.strip()] or None


async def check_tasks(
    wanted: list[str] | None, registry: AdapterRegistry, visible: Callable[[str], bool] | None = None
) -> None:
    """Raise ``TasksRequiredError``, ``TooManyTasksError`` or ``UnknownTaskError`` for ``wanted``;
    ``visible``: the names the caller may be told of (a tenant's key is never told another's)."""
    limit = registry.max_tasks
    if wanted is None:
        if len(registry) > limit:
            raise TasksRequiredError(
                f"this registry holds {len(registry):,} adapters: name the tasks you want with ?tasks= "
                f"(at most {limit})",
                field="tasks",
            )
        return
    adapters = list(dict.fromkeys(t for t in wanted if t != BASE_TASK))
    if len(adapters) > limit:
        raise TooManyTasksError(
            f"{len(adapters)} adapters asked for in one request; the limit is {limit} "
            "(MEMVIT_MAX_TASKS_PER_REQUEST)",
            field="tasks",
        )
    if registry.unknown(adapters):
        await asyncio.to_thread(registry.lookup_refresh)  # registered elsewhere a moment ago?
        if unknown := registry.unknown(adapters):
            known = (e.name for e in registry.catalog.page(None, _NAMES_SHOWN))
            raise unknown_tasks_error(unknown, known, len(registry), visible=visible)


def unknown_tasks_error(
    unknown: list[str],
    known: Iterable[str] | AdapterSet,
    registered: int,
    why: str = "",
    visible: Callable[[str], bool] | None = None,
) -> UnknownTaskError:
    """The 422 for ``unknown`` tasks, naming some of the ``registered`` ones (only those ``visible`` to
    the caller, and then without the count); ``why``: how it came about."""
    names_known = known.names if isinstance(known, AdapterSet) else known
    shown = [n for n in names_known if visible is None or visible(n)][:_NAMES_SHOWN]
    names = [BASE_TASK, *shown]
    if visible is not None:
        more = " (GET /adapters lists yours)"
    else:
        more = (
            f" and {registered + 1 - len(names):,} more (GET /adapters)"
            if registered + 1 > len(names)
            else ""
        )
    error = UnknownTaskError(f"unknown task(s) {unknown}{why}; this server has {names}{more}", field="tasks")
    error.unknown, error.why = tuple(unknown), why  # for re-wording it for a key (routers/classify.py)
    return error
