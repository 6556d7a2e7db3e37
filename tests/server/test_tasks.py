"""Task names (server/tasks.py): ``?tasks=`` parsed, checked against a set, one error for both moments."""

from __future__ import annotations

import pytest

from memory_core import AdapterSet
from server.errors import UnknownTaskError
from server.tasks import check_tasks, parse_tasks, unknown_tasks_error
from tests.conftest import random_adapter, tiny_engine


def test_parse_and_check_tasks() -> None:
    assert parse_tasks(None) is None and parse_tasks([" ", ""]) is None
    assert parse_tasks(["a,b", " c "]) == ["a", "b", "c"]
    engine = tiny_engine()
    live = AdapterSet((engine.prepare(random_adapter("a", engine)),))
    check_tasks(["base", "a"], live)
    with pytest.raises(UnknownTaskError, match=r"unknown task\(s\) \['gone'\]"):
        check_tasks(["a", "gone"], live)


def test_one_error_for_unknown_tasks_when_asked_and_when_removed_meanwhile() -> None:
    engine = tiny_engine()
    live = AdapterSet((engine.prepare(random_adapter("a", engine)),))
    with pytest.raises(UnknownTaskError) as asked:
        check_tasks(["zz", "yy", "zz"], live)
    assert str(asked.value) == "unknown task(s) ['zz', 'yy', 'zz']; this server has ['base', 'a']"
    removed = unknown_tasks_error(["b"], live, ": removed while the request waited")
    assert (
        str(removed)
        == "unknown task(s) ['b']: removed while the request waited; this server has ['base', 'a']"
    )
    assert asked.value.field == removed.field == "tasks" and removed.status == 422
