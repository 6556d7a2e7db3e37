"""Per-key limits and weights from the keys file, on a real server: 429 with Retry-After and the
standard error body (before the body is read where the headers suffice), on /classify and the Open
Inference Protocol alike; 413 over a key's largest request; a reload changes them. A key's weight
reaching the fused passes and its images decoded in turn: test_key_weights.py."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest

from memvit.server.settings import Settings
from memvit.server.tenancy.key_file import add_key, set_policy
from memvit.server.tenancy.policy import Limits, Policy
from tests.server.conftest import TOKEN, free_port, published, running_server
from tests.server.test_api import jpeg, post_image
from tests.server.test_guard import exchange, multipart, request_head

RELOAD = 0.2
SLOW = 0.01  # images per second: no bucket refills noticeably during a test


@dataclass
class Limited:
    url: str
    keys_file: Path
    keys: dict[str, str]  # id -> key

    def client(self, who: str | None) -> httpx.Client:
        token = TOKEN if who == "admin" else self.keys.get(who or "")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])


@pytest.fixture
def limited(tiny_weights, store, tmp_path) -> Iterator[Limited]:
    keys_file = tmp_path / "keys.json"
    policies = {
        "metered": Policy(limits=Limits(images_per_second=SLOW, burst=3, images_per_request=2)),
        "bursty": Policy(limits=Limits(images_per_second=SLOW, burst=3)),
        "single": Policy(limits=Limits(requests_in_flight=1)),
        "free": Policy(),
    }
    keys = {
        name: add_key(keys_file, name, ["*"], read=True, write=False, policy=p)
        for name, p in policies.items()
    }
    set_policy(keys_file, "anonymous", Policy(limits=Limits(images_per_second=SLOW, burst=1)))
    settings = Settings(
        _env_file=None,
        weights=tiny_weights,
        adapter_store=store,
        port=free_port(),
        admin_token=TOKEN,
        api_keys_file=keys_file,
        api_keys_reload_seconds=RELOAD,
        max_wait_ms=2,
        usage_log=False,
    )
    with running_server(settings) as url:
        yield Limited(url, keys_file, keys)


def assert_rate_limited(r: httpx.Response, key: str) -> None:
    assert r.status_code == 429, r.text
    assert int(r.headers["retry-after"]) >= 1
    error = r.json()["error"]
    assert error["type"] == "RateLimitedError" and f"key {key!r} is over its limit" in error["message"]


def test_past_its_rate_a_key_gets_429_and_others_do_not(limited) -> None:
    with limited.client("metered") as metered, limited.client("free") as free:
        assert post_image(metered, jpeg()).status_code == 200  # 2 of 3 tokens left
        r = post_image(metered, jpeg(), jpeg(), jpeg())  # over its largest request: never passes
        assert r.status_code == 413 and r.json()["error"]["field"] == "image", r.text
        assert "key 'metered' may send at most 2 at once (its images_per_request)" in r.text
        assert post_image(metered, jpeg(), jpeg()).status_code == 200  # the bucket is empty now
        assert_rate_limited(post_image(metered, jpeg()), "metered")
        for _ in range(5):  # another key is untouched
            assert post_image(free, jpeg(), jpeg(), jpeg()).status_code == 200
    # Refused from the headers alone: 10 MB announced, not a byte of it read.
    head = request_head("/classify", length=10_000_000, token=limited.keys["metered"])
    answer = exchange(limited.port, head, timeout=10)
    assert (answer.status, answer.sent) == (429, 0), answer
    assert answer.headers["retry-after"] == str(round(1 / SLOW)) and answer.headers["connection"] == "close"
    expected = [
        'memvit_key_limited_total{key="metered",limit="images_per_second"} 2.0',
        'memvit_key_limited_total{key="metered",limit="images_per_request"} 1.0',
        'memvit_key_images_total{key="free"} 15.0',
    ]
    with limited.client("admin") as admin:
        metrics = published(admin, expected)
    assert all(line in metrics for line in expected), metrics


def test_a_request_larger_than_the_tokens_left_is_refused_after_its_body(limited) -> None:
    with limited.client("bursty") as bursty:
        assert post_image(bursty, jpeg(), jpeg()).status_code == 200  # one token left
        r = post_image(bursty, jpeg(), jpeg())  # counted once its images are: 429, nothing taken
        assert_rate_limited(r, "bursty")
        assert int(r.headers["retry-after"]) == round(1 / SLOW)  # one image short, at 0.01/s
        assert "no room for 2 images now" in r.json()["error"]["message"]
        assert post_image(bursty, jpeg()).status_code == 200  # the token the refusal did not take


def test_requests_in_flight_are_limited_per_key(limited) -> None:
    # One request of "single" held open: its body never finishes arriving.
    holder = socket.create_connection(("127.0.0.1", limited.port), timeout=10)
    part = next(multipart("image", 10))  # the start of a valid form: the parser waits for the rest
    holder.sendall(request_head("/classify", length=10_000, token=limited.keys["single"]) + part)
    try:
        with limited.client("single") as single:  # until the server has admitted it
            deadline = time.monotonic() + 10
            while (r := post_image(single, jpeg())).status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.05)
        assert (
            r.json()["error"]["message"]
            == "key 'single' has 1 requests in flight, its limit (requests_in_flight)"
        )
        # From the headers alone: 10 MB announced, not a byte of it read.
        head = request_head("/classify", length=10_000_000, token=limited.keys["single"])
        answer = exchange(limited.port, head, timeout=10)
        assert (answer.status, answer.sent, answer.headers["retry-after"]) == (429, 0, "1"), answer
        with limited.client("free") as free:
            assert post_image(free, jpeg()).status_code == 200
    finally:
        holder.close()
    with limited.client("single") as single:  # the slot comes back once the first one is gone
        deadline = time.monotonic() + 10
        while (r := post_image(single, jpeg())).status_code == 429 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert r.status_code == 200, r.text


def test_the_callers_without_a_key_have_limits_too(limited) -> None:
    with limited.client(None) as anonymous, limited.client("admin") as admin:
        assert post_image(anonymous, jpeg()).status_code == 200
        assert_rate_limited(post_image(anonymous, jpeg()), "anonymous")
        assert post_image(admin, jpeg(), jpeg(), jpeg()).status_code == 200  # the admin has none here


def test_limits_reach_the_open_inference_protocol(limited, tiny_weights) -> None:
    http = pytest.importorskip(
        "tritonclient.http", reason="tritonclient is not installed (the dev extra has it)"
    )

    def pixels(n: int) -> str:
        tensor = {
            "name": "PIXELS",
            "shape": [n, 3, 32, 32],
            "datatype": "FP32",
            "data": [0.0] * n * 3 * 32 * 32,
        }
        return json.dumps({"inputs": [tensor]})

    with limited.client("metered") as metered:
        assert metered.post("/v2/models/base/infer", content=pixels(2)).status_code == 200  # 1 token left
        r = metered.post("/v2/models/base/infer", content=pixels(3))
        assert r.status_code == 413 and "may send at most 2 at once" in r.json()["error"], r.text
        assert metered.post("/v2/models/base/infer", content=pixels(1)).status_code == 200
        r = metered.post("/v2/models/base/infer", content=pixels(1))
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert (
            list(r.json()) == ["error"] and "is over its limit" in r.json()["error"]
        )  # the protocol's shape
    # The real client sees the protocol's error too.
    with http.InferenceServerClient(limited.url.removeprefix("http://"), network_timeout=30.0) as triton:
        tensor = http.InferInput("PIXELS", [1, 3, 32, 32], "FP32")
        tensor.set_data_from_numpy(np.zeros((1, 3, 32, 32), np.float32))
        auth = {"Authorization": f"Bearer {limited.keys['metered']}"}
        with pytest.raises(Exception, match=r"is over its limit of 0\.01 images per second"):
            triton.infer("base", [tensor], headers=auth)


def test_a_reload_changes_the_limits(limited) -> None:
    with limited.client("metered") as metered:
        assert post_image(metered, jpeg(), jpeg()).status_code == 200
        assert post_image(metered, jpeg()).status_code == 200
        assert_rate_limited(post_image(metered, jpeg()), "metered")
        set_policy(limited.keys_file, "metered", Policy())  # as `memvit keys set metered --no-limits`
        deadline = time.monotonic() + 10
        while (r := post_image(metered, jpeg())).status_code == 429 and time.monotonic() < deadline:
            time.sleep(RELOAD / 2)
        assert r.status_code == 200, r.text
        assert post_image(metered, jpeg(), jpeg(), jpeg()).status_code == 200  # no largest request either
