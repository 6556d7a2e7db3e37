"""Usage per key: counted as requests are answered, written beside the adapters one record per
interval and replica (a line in the folder, an object in a bucket), never lost to a retry or a torn
line, read back by ``GET /usage`` (a key: its own) and ``memvit usage``."""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from memvit.server.cli import app as cli
from memvit.server.settings import Settings
from memvit.server.store import open_store
from memvit.server.tenancy.key_file import add_key
from memvit.server.tenancy.usage import UsageMeter, UsageRow, summarize
from memvit.server.tenancy.usage_log import LocalUsageLog, ObjectUsageLog, encode
from tests.server.conftest import TOKEN, free_port, running_server
from tests.server.test_api import jpeg, post_image, register

TODAY = datetime.datetime.now(datetime.timezone.utc).date()


def rows(usage_log, **kw) -> list[tuple]:
    return [(r.key, r.task, r.requests, r.images) for r in summarize(usage_log, TODAY, TODAY, **kw)]


def test_replicas_write_their_own_records_and_reading_adds_them_up(tmp_path) -> None:
    usage_log = LocalUsageLog(tmp_path)
    one, two = UsageMeter(usage_log, "one", 60), UsageMeter(usage_log, "two", 60)
    one.record("acme", 2, ["base", "acme-cats"])
    one.record("acme", 1, ["base"])
    two.record("acme", 3, ["base", "acme-cats", "acme-dogs"])
    two.record("globex", 1, ["base"])
    assert (one.flush(), two.flush(), one.flush()) == (1, 1, 0)  # nothing counted: no record
    one.record("acme", 4, ["base"])
    assert one.flush() == 1
    assert rows(usage_log) == [
        ("acme", "base", 4, 10),
        ("acme", "acme-cats", 2, 5),
        ("acme", "acme-dogs", 1, 3),
        ("globex", "base", 1, 1),
    ]
    files = sorted(p.name for p in (tmp_path / ".usage" / TODAY.isoformat()).iterdir())
    assert files == ["one.jsonl", "two.jsonl"]  # each replica its own file: no writer shares one
    lines = (tmp_path / ".usage" / TODAY.isoformat() / "one.jsonl").read_text().splitlines()
    assert [json.loads(line)["seq"] for line in lines] == [1, 2]  # one line per interval
    assert rows(usage_log, keys="globex".__eq__) == [("globex", "base", 1, 1)]


def test_a_torn_line_is_skipped_and_never_swallows_the_next(tmp_path) -> None:
    usage_log = LocalUsageLog(tmp_path)
    meter = UsageMeter(usage_log, "r", 60)
    meter.record("acme", 1, ["base"])
    meter.flush()
    path = tmp_path / ".usage" / TODAY.isoformat() / "r.jsonl"
    with open(path, "ab") as f:  # a replica killed in the middle of its write
        f.write(encode({"replica": "r", "seq": 99, "day": TODAY.isoformat(), "usage": {}})[:25])
    meter.record("acme", 2, ["base"])
    meter.flush()
    assert rows(usage_log) == [("acme", "base", 2, 3)]
    assert len(path.read_text().splitlines()) == 3  # the torn line stands alone


def test_a_record_that_could_not_be_written_is_kept_and_counted_once(tmp_path) -> None:
    (tmp_path / ".usage").write_text("not a folder")  # every write fails, as a full or gone disk would
    usage_log = LocalUsageLog(tmp_path)
    meter = UsageMeter(usage_log, "r", 60)
    meter.record("acme", 1, ["base"])
    with pytest.raises(OSError):
        meter.flush()
    meter.record("acme", 1, ["base"])
    with pytest.raises(OSError):
        meter.flush()  # two intervals kept, oldest first
    (tmp_path / ".usage").unlink()
    assert meter.flush() == 2
    assert rows(usage_log) == [("acme", "base", 2, 2)]
    # A retry after a write that failed only on the way back (written, but an error seen): same seq,
    # counted once.
    record = json.loads((tmp_path / ".usage" / TODAY.isoformat() / "r.jsonl").read_text().splitlines()[0])
    usage_log.append(record)
    assert rows(usage_log) == [("acme", "base", 2, 2)]


def test_a_bucket_gets_one_object_per_record(s3_env) -> None:
    from tests.server.s3 import new_bucket

    store = open_store(f"s3://{new_bucket(s3_env)}/adapters")
    usage_log = ObjectUsageLog(store)
    one, two = UsageMeter(usage_log, "one", 60), UsageMeter(usage_log, "two", 60)
    for meter, n in ((one, 1), (two, 2), (one, 3)):
        meter.record("acme", n, ["base", "acme-cats"])
        meter.flush()
    keys = sorted(store._list(".usage/"))
    day = TODAY.isoformat()
    assert keys == [f".usage/{day}/one/0000000001.json", f".usage/{day}/one/0000000002.json",
                    f".usage/{day}/two/0000000001.json"]  # fmt: skip
    record = json.loads(store._get(keys[0])[0])
    usage_log.append(record)  # a retry of a record already there: create-if-absent, no second copy
    assert len(store._list(".usage/")) == 3
    assert rows(usage_log) == [("acme", "base", 3, 6), ("acme", "acme-cats", 3, 6)]
    assert store._list(".usage/nothing") == {}


def test_a_range_is_checked() -> None:
    usage_log = LocalUsageLog(Path("/nonexistent"))
    assert summarize(usage_log, TODAY, TODAY) == []  # nothing written yet: nothing, not an error
    with pytest.raises(ValueError, match=r"ends .* before it starts"):
        summarize(usage_log, TODAY, TODAY - datetime.timedelta(days=1))
    with pytest.raises(ValueError, match="367 days asked for; at most 366"):
        summarize(usage_log, TODAY - datetime.timedelta(days=366), TODAY)


@pytest.fixture
def two_replicas(tiny_weights, store, tmp_path, make_bundle) -> Iterator[tuple[list[str], dict[str, str]]]:
    keys_file = tmp_path / "keys.json"
    keys = {
        name: add_key(keys_file, name, [f"{name}-*"], read=True, write=False) for name in ("acme", "globex")
    }
    with ExitStack() as stack:
        urls = []
        for _ in range(2):
            settings = Settings(
                _env_file=None, weights=tiny_weights, adapter_store=store, port=free_port(),
                admin_token=TOKEN, api_keys_file=keys_file, max_wait_ms=2, store_poll_seconds=0.2,
                usage_interval_seconds=0.2,
            )  # fmt: skip
            urls.append(stack.enter_context(running_server(settings)))
        auth = {"Authorization": f"Bearer {TOKEN}"}
        with httpx.Client(base_url=urls[0], headers=auth) as admin:
            assert register(admin, make_bundle("acme-cats").to_bytes()).status_code == 201
        deadline = time.monotonic() + 10  # until the other replica's poll has seen it
        while "acme-cats" not in httpx.get(f"{urls[1]}/adapters", headers=auth).text:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        yield urls, keys


def usage(url: str, token: str | None, **params) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.get(f"{url}/usage", headers=headers, params=params, timeout=30)


def test_usage_over_two_replicas_by_key_task_and_day(two_replicas, store) -> None:
    (one, two), keys = two_replicas

    def send(url: str, who: str | None, images: int = 1, **params) -> None:
        files = [("image", (f"{i}.jpg", jpeg(), "image/jpeg")) for i in range(images)]
        headers = {"Authorization": f"Bearer {keys[who]}"} if who else {}
        r = httpx.post(f"{url}/classify", files=files, params=params, headers=headers, timeout=30)
        assert r.status_code == 200, r.text

    for _ in range(3):
        send(one, "acme", tasks="acme-cats")
    send(two, "acme", 2)  # a key's unfiltered request: base and its own adapters
    for _ in range(2):
        send(two, "globex")
    send(one, None)  # anonymous, unfiltered: every adapter
    expected = [
        {"day": TODAY.isoformat(), "key": "acme", "task": "base", "requests": 4, "images": 5},
        {"day": TODAY.isoformat(), "key": "acme", "task": "acme-cats", "requests": 4, "images": 5},
        {"day": TODAY.isoformat(), "key": "anonymous", "task": "base", "requests": 1, "images": 1},
        {"day": TODAY.isoformat(), "key": "anonymous", "task": "acme-cats", "requests": 1, "images": 1},
        {"day": TODAY.isoformat(), "key": "globex", "task": "base", "requests": 2, "images": 2},
    ]
    deadline = time.monotonic() + 20
    while (seen := usage(two, TOKEN).json()["usage"]) != expected and time.monotonic() < deadline:
        time.sleep(0.1)  # each replica writes its interval within 0.2 s
    assert seen == expected
    # A key reads its own, from either replica; another key's is refused; no key, no usage.
    assert usage(one, keys["acme"]).json()["usage"] == expected[:2]
    assert usage(two, keys["globex"], key="globex").json()["usage"] == expected[4:]
    r = usage(one, keys["globex"], key="acme")
    assert r.status_code == 403 and r.json()["error"]["field"] == "key", r.text
    assert usage(one, None).status_code == 401
    assert usage(one, TOKEN, key="globex").json()["usage"] == expected[4:]
    report = usage(one, TOKEN, since=(TODAY - datetime.timedelta(days=3)).isoformat()).json()
    assert report["since"] == (TODAY - datetime.timedelta(days=3)).isoformat() and report["usage"] == expected
    r = usage(one, TOKEN, since="2026-13-01")
    assert r.status_code == 422 and r.json()["error"]["field"] == "since"
    r = usage(one, TOKEN, since=TODAY.isoformat(), until=(TODAY - datetime.timedelta(days=1)).isoformat())
    assert r.status_code == 400 and "before it starts" in r.json()["error"]["message"]

    # The command line reads the same records from the store.
    runner = CliRunner()
    out = runner.invoke(cli, ["usage", "--store", str(store), "--json"])
    assert out.exit_code == 0, out.output
    assert [json.loads(line) for line in out.stdout.splitlines()] == expected
    out = runner.invoke(cli, ["usage", "--store", str(store), "--totals", "--key", "acme"])
    assert out.stdout.splitlines() == ["key\trequests\timages\tadapter_rows", "acme\t4\t5\t5"]
    out = runner.invoke(cli, ["usage", "--store", str(store), "--since", "2020-01-01"])
    assert out.exit_code == 2 and "at most 366" in out.output

    # Metrics per key id, per replica.
    metrics = httpx.get(f"{one}/metrics").text
    assert 'memvit_key_requests_total{key="acme"} 3.0' in metrics
    assert 'memvit_key_adapter_rows_total{key="acme"} 3.0' in metrics
    assert 'memvit_key_images_total{key="anonymous"} 1.0' in metrics


def test_a_stop_writes_what_was_counted(tiny_weights, store) -> None:
    settings = Settings(
        _env_file=None, weights=tiny_weights, adapter_store=store, port=free_port(), admin_token=TOKEN,
        max_wait_ms=2, usage_interval_seconds=3600,
    )  # fmt: skip
    with running_server(settings) as url, httpx.Client(base_url=url, timeout=30) as http:
        for _ in range(3):
            assert post_image(http, jpeg()).status_code == 200
        assert usage(url, TOKEN).json()["usage"] == []  # an hour from its first record
    assert summarize(LocalUsageLog(store), TODAY, TODAY) == [
        UsageRow(TODAY.isoformat(), "anonymous", "base", 3, 3)
    ]


def test_usage_can_be_turned_off(tiny_weights, store) -> None:
    settings = Settings(
        _env_file=None, weights=tiny_weights, adapter_store=store, port=free_port(), admin_token=TOKEN,
        usage_log=False,
    )  # fmt: skip
    with running_server(settings) as url, httpx.Client(base_url=url, timeout=30) as http:
        assert post_image(http, jpeg()).status_code == 200
        r = usage(url, TOKEN)
        assert r.status_code == 404 and "MEMVIT_USAGE_LOG=false" in r.json()["error"]["message"]
    assert not (store / ".usage").exists()
