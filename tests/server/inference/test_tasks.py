"""Task names (server/inference/tasks.py): ``?tasks=`` parsed, checked against the registry, one error for
both moments (asked for, and deleted while the request waited)."""

from __future__ import annotations

import asyncio

import pytest

from memvit.adapters import bundle_for
from memvit.memory_core import AdapterSet, LiveAdapters
from memvit.server.errors import UnknownTaskError
from memvit.server.inference.tasks import check_tasks, parse_tasks, unknown_tasks_error
from memvit.server.registry import AdapterRegistry
from memvit.server.store import LocalStore
from tests.conftest import random_adapter, tiny_engine


@pytest.fixture
def registry(tmp_path) -> AdapterRegistry:
    engine = tiny_engine()
    registry = AdapterRegistry(LiveAdapters(engine), LocalStore(tmp_path / "store"), max_bundle_bytes=1 << 22)
    registry.open()
    registry.register(bundle_for(random_adapter("a", engine), engine).to_bytes())
    return registry


def test_parse_and_check_tasks(registry) -> None:
    assert parse_tasks(None) is None and parse_tasks([" ", ""]) is None
    assert parse_tasks(["a,b", " c "]) == ["a", "b", "c"]
    asyncio.run(check_tasks(["base", "a"], registry))
    with pytest.raises(UnknownTaskError, match=r"unknown task\(s\) \['gone'\]"):
        asyncio.run(check_tasks(["a", "gone"], registry))


def test_one_error_for_unknown_tasks_when_asked_and_when_removed_meanwhile(registry) -> None:
    with pytest.raises(UnknownTaskError) as asked:
        asyncio.run(check_tasks(["zz", "yy", "zz"], registry))
    assert str(asked.value) == "unknown task(s) ['zz', 'yy']; this server has ['base', 'a']"
    live = registry.live.current
    removed = unknown_tasks_error(["b"], live, len(live), ": removed while the request waited")
    assert (
        str(removed)
        == "unknown task(s) ['b']: removed while the request waited; this server has ['base', 'a']"
    )
    assert asked.value.field == removed.field == "tasks" and removed.status == 422


def test_the_error_names_a_few_tasks_not_the_whole_registry() -> None:
    engine = tiny_engine()
    many = AdapterSet(tuple(engine.prepare(random_adapter(f"t{i:03d}", engine)) for i in range(30)))
    message = str(unknown_tasks_error(["x"], many, 30_000))
    assert message.endswith("'t019'] and 29,980 more (GET /adapters)")
