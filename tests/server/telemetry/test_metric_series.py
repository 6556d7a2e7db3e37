"""/metrics stays bounded whatever the registry holds: per-task series for base, the configured
adapters and the N most asked, the rest under ``other``; per-key series by key id."""

from __future__ import annotations

import random
import re

import httpx
import pytest

from memvit.server.http.app import create_app
from memvit.server.settings import Settings
from memvit.server.store import open_store
from memvit.server.telemetry.metrics import Metrics
from memvit.server.telemetry.task_labels import OTHER, TaskLabels
from tests.server.conftest import TOKEN, free_port, running_server
from tests.server.filling import register_in_bulk
from tests.server.test_api import jpeg


def task_series(text: str, metric: str = "memvit_task_requests_total") -> dict[str, float]:
    return {m[0]: float(m[1]) for m in re.findall(rf'^{metric}\{{task="([^"]*)"\}} (\S+)$', text, re.M)}


def test_series_stay_bounded_under_100000_adapters_asked_for() -> None:
    """100,000 distinct adapters asked for (a Zipf-like few often, the rest once or twice): a fixed
    number of series, and the N most asked among them."""
    top = 20
    metrics = Metrics(TaskLabels(named=["pinned"], top=top))
    rng = random.Random(0)
    names = [f"tenant-{i:06d}" for i in range(100_000)]
    asked: dict[str, int] = {}
    for i, name in enumerate(names):
        tasks = ["base", name]
        if i % 10 == 0:
            tasks.append(names[min(int(rng.paretovariate(1.1)) - 1, 99)])  # the hot hundred
        if i % 1000 == 0:
            tasks.append("pinned")
        for t in tasks[1:]:
            asked[t] = asked.get(t, 0) + 1
        metrics.answered("acme" if i % 2 else "globex", 1, tasks, rows=len(tasks) - 1)
        if i % 20_000 == 0:
            metrics.render()  # scrapes along the way choose the top tasks again
    text = metrics.render().decode()
    series = task_series(text)
    assert len(series) <= 1 + 1 + top + 1  # base, pinned, the top N, other
    assert {"base", "pinned", OTHER} <= set(series)
    hottest = sorted((t for t in asked if t != "pinned"), key=lambda t: -asked[t])[:top]
    # The chosen ones are the most asked (a task level with the N-th may hold its slot: 10% margin).
    assert len(set(series) & set(hottest)) >= top - 2, sorted(series)
    assert len(re.findall(r"^memvit_task_images_total\{", text, re.M)) == len(series)
    assert len(re.findall(r'^memvit_key_requests_total\{key="(acme|globex)"\}', text, re.M)) == 2
    assert sum(1 for line in text.splitlines() if line and not line.startswith("#")) < 200


def test_a_small_registry_is_counted_exactly_and_a_newly_hot_task_takes_a_slot() -> None:
    labels = TaskLabels(top=2)
    metrics = Metrics(labels)
    for task in ("a", "b", "a"):
        metrics.answered("k", 1, ["base", task], rows=1)
    assert task_series(metrics.render().decode()) == {"base": 3, "a": 2, "b": 1}  # slots free: exact
    for _ in range(5):
        metrics.answered("k", 1, ["c"], rows=1)  # no slot free: "other" until the next scrape
    assert task_series(metrics.render().decode()) == {"base": 3, "a": 2, OTHER: 5}  # c took b's slot
    metrics.answered("k", 1, ["c", "b"], rows=2)
    assert task_series(metrics.render().decode()) == {"base": 3, "a": 2, "c": 1, OTHER: 6}


def test_with_top_zero_only_base_and_the_named(tmp_path) -> None:
    metrics = Metrics(TaskLabels(named=["x"], top=0))
    metrics.answered("k", 2, ["base", "x", "y", "z"], rows=6)
    assert task_series(metrics.render().decode(), "memvit_task_images_total") == {"base": 2, "x": 2, OTHER: 4}


@pytest.mark.parametrize("adapters", [240])
def test_a_server_with_hundreds_of_adapters_exposes_a_bounded_few(
    tiny_weights, store, make_bundle, adapters
) -> None:
    names = [f"t{i:03d}" for i in range(adapters)]
    register_in_bulk(open_store(store), [(b, b.to_bytes()) for b in map(make_bundle, names)], as_index=True)
    settings = Settings(
        _env_file=None, weights=tiny_weights, adapter_store=store, port=free_port(), admin_token=TOKEN,
        max_wait_ms=2, metrics_top_tasks=4, metrics_tasks=["t239"], usage_log=False,
    )  # fmt: skip
    hot = names[100:104]
    # One process: a scrape is when the top tasks are chosen (a group's processes choose at publishing).
    with (
        running_server(settings, create_app(settings)) as url,
        httpx.Client(base_url=url, timeout=60) as http,
    ):

        def ask(tasks: list[str]) -> None:
            r = http.post("/classify", files={"image": ("a.jpg", jpeg())}, params={"tasks": ",".join(tasks)})
            assert r.status_code == 200, r.text

        for start in range(0, adapters, 60):  # every adapter asked for once
            ask(names[start : start + 60])
        for _ in range(3):
            ask(hot)
        first = task_series(http.get("/metrics").text)
        for _ in range(2):
            ask(hot)
        second = task_series(http.get("/metrics").text)
    # The first scrape chose the hot four (asked 4 times) over the first four asked (once): until then
    # the hot ones were counted under "other", and the first four lost their series.
    assert first == {"t239": 1.0, OTHER: adapters - 1 - 4 + 3 * 4}  # the first four: own series, gone
    assert set(second) == {"t239", *hot, OTHER}  # base was never asked for by name
    assert {t: second[t] for t in hot} == dict.fromkeys(hot, 2.0)  # counted since they took a slot


def test_a_task_keeps_its_series_until_another_is_asked_clearly_more() -> None:
    """Two tasks level at rank N do not swap series at every scrape: a challenger must be asked 10%
    more often than the holder to take its slot."""
    metrics = Metrics(TaskLabels(top=1))
    for _ in range(10):
        metrics.answered("k", 1, ["z"], rows=1)  # z holds the one slot
    for _ in range(10):
        metrics.answered("k", 1, ["y"], rows=1)  # level with z (and first by name)
    assert set(task_series(metrics.render().decode())) == {"z", OTHER}
    for _ in range(2):
        metrics.answered("k", 1, ["y"], rows=1)  # 12: more than 10% over z's 10
    assert set(task_series(metrics.render().decode())) == {OTHER}  # z's series is gone...
    metrics.answered("k", 1, ["y"], rows=1)
    assert task_series(metrics.render().decode()) == {"y": 1.0, OTHER: 12.0}  # ...and y counts from now


def test_answers_are_tallied_until_read_and_the_tallies_stay_bounded(monkeypatch) -> None:
    """A batch's answers are tallied by (key, tasks) and reach the series when the metrics are read;
    with many distinct asks and no reader, they are counted once the tallies reach their bound."""
    monkeypatch.setattr("memvit.server.telemetry.metrics.MAX_TALLIES", 8)
    metrics = Metrics(TaskLabels(top=100))
    metrics.answered_batch(
        [("k", 3, 4, ("base", "a"), 4), ("j", 1, 1, ("a",), 1), ("k", 1, 2, ("base", "a"), 2)]
    )
    assert metrics.task_requests.labels("a")._value.get() == 0  # tallied, not yet on the series
    assert task_series(metrics.render().decode()) == {"base": 4, "a": 5}
    assert task_series(metrics.render().decode(), "memvit_task_images_total") == {"base": 6, "a": 7}
    text = metrics.render().decode()
    assert (
        'memvit_key_adapter_rows_total{key="k"} 6.0' in text
        and 'memvit_key_images_total{key="j"} 1.0' in text
    )
    for i in range(50):  # 50 distinct asks, nobody reading: never more than the bound held
        metrics.answered("k", 1, [f"t{i}"], rows=1)
        assert len(metrics._tallies) <= 8
    assert sum(task_series(metrics.render().decode()).values()) == 4 + 5 + 50
