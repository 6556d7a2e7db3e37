"""The server with two API processes on one port (``MEMVIT_API_PROCESSES=2``), in each front end:
the same answers and the same error bodies as one process, registry changes seen by every process
within one poll, per-key limits not multiplied, ``/metrics`` one view, the protocol, a killed model
process answered 503 (not a hang) and restarted, and SIGTERM stopping every child.

One group per front end for the whole module (starting three processes that import torch is most
of this module's time); a single-process server on the same store answers the same requests, so
"identical" is compared, not assumed. The tests of each group run in file order, the stop last.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlparse

import httpx
import numpy as np
import pytest

from memvit.server.settings import Settings
from memvit.server.tenancy.key_file import add_key
from memvit.server.tenancy.policy import Limits, Policy
from tests.server.conftest import TOKEN, free_port, running_server
from tests.server.launcher import ServerGroup
from tests.server.test_api import jpeg, post_image, register

POLL = 0.2
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def shared(tiny_weights, tmp_path_factory) -> tuple[Settings, dict[str, str]]:
    """One store and keys file for the module; ``limited``'s bucket never refills during a test."""
    tmp = tmp_path_factory.mktemp("front")
    keys_file = tmp / "keys.json"
    slow = Policy(limits=Limits(images_per_second=0.001, burst=2))
    keys = {"limited": add_key(keys_file, "limited", ["*"], read=True, write=False, policy=slow)}
    settings = Settings(
        weights=tiny_weights,
        adapter_store=tmp / "store",
        port=free_port(),
        admin_token=TOKEN,
        api_keys_file=keys_file,
        api_keys_reload_seconds=POLL,
        store_poll_seconds=POLL,
        max_wait_ms=2,
        usage_log=False,
        server_timing=True,
    )
    return settings, keys


@pytest.fixture(scope="module", params=["model-process", "model-process+device", "replicas"])
def group(request, shared) -> Iterator[ServerGroup]:
    """``+device``: JPEGs checked in the API processes and decoded by the model process's batcher
    (``MEMVIT_DECODE_DEVICE=device``, torchvision's CPU decoder here): per-image items on the wire;
    its decoder calls padded to 4 or 16 images (the single process beside it pads none)."""
    settings, _ = shared
    mode, _, device = request.param.partition("+")
    padded = [4, 16] if device else []
    settings = settings.model_copy(
        update={"port": free_port(), "decode_device": device or "cpu", "device_decode_call_sizes": padded}
    )
    with ServerGroup(settings, 2, mode) as running:
        running.mode, running.settings = mode, settings
        yield running


@pytest.fixture(scope="module")
def single(group) -> Iterator[str]:
    """One process on the same store, decoding as the group does."""
    unpadded = {"port": free_port(), "device_decode_call_sizes": []}
    with running_server(group.settings.model_copy(update=unpadded)) as url:
        yield url


def fresh(url: str, **headers: str) -> httpx.Client:
    """A client on a new connection each request, so requests spread over the API processes."""
    limits = httpx.Limits(max_keepalive_connections=0)
    return httpx.Client(base_url=url, timeout=20, headers=headers, limits=limits)


def bad_requests() -> list[Callable[[httpx.Client], httpx.Response]]:
    oip = "/v2/models/base/infer"
    return [
        lambda c: post_image(c, b"\xff\xd8\xff\xe0 a JPEG that stops here"),
        lambda c: post_image(c, b"just some text, no image here"),
        lambda c: post_image(c, b""),
        lambda c: post_image(c, jpeg(), tasks="nope"),
        lambda c: post_image(c, jpeg(), top_k=0),
        lambda c: post_image(c, *[jpeg()] * 17),
        lambda c: c.post("/classify", json={"image": "x"}),
        lambda c: c.post("/adapters", files={"bundle": ("b.safetensors", b"not a bundle")}, headers=AUTH),
        lambda c: c.post("/adapters", files={"bundle": ("b.safetensors", b"x")}),  # no token: 401
        lambda c: c.delete("/adapters/nope", headers=AUTH),
        lambda c: c.get("/adapters/nope"),
        lambda c: c.get("/classify"),
        lambda c: c.get("/adapters", headers={"Host": "evil.example"}),
        lambda c: c.post(oip, content=b"not json"),
        lambda c: c.post(
            oip,
            content=json.dumps(
                {"inputs": [{"name": "X", "datatype": "INT8", "shape": [1], "data": [1]}]}
            ).encode(),
        ),
        lambda c: c.get("/v2/models/nope"),
    ]


def test_error_bodies_are_the_single_process_servers(group, single) -> None:
    with fresh(group.url) as many, fresh(single) as one:
        for i, make in enumerate(bad_requests()):
            for _ in range(2):  # two connections: most likely both API processes
                got, expected = make(many), make(one)
                assert (got.status_code, got.json()) == (expected.status_code, expected.json()), i
                assert got.headers.get("retry-after") == expected.headers.get("retry-after")


def test_answers_are_the_single_process_servers(group, single) -> None:
    image = jpeg((10, 200, 90), (64, 50))
    with fresh(group.url) as many, fresh(single) as one:
        expected = post_image(one, image, image, logits="true").json()
        for _ in range(3):
            answer = post_image(many, image, image, logits="true")
            timed = {part.split(";")[0].strip() for part in answer.headers["server-timing"].split(",")}
            assert {"receive", "decode", "queue", "pass", "respond"} <= timed  # the model's stages too
            got = answer.json()
            for a, b in zip(got["results"], expected["results"], strict=True):
                assert a["image"] == b["image"] and a["tasks"].keys() == b["tasks"].keys()
                for task in a["tasks"]:
                    assert np.allclose(a["tasks"][task]["logits"], b["tasks"][task]["logits"], atol=1e-5)
                    assert (
                        a["tasks"][task]["predictions"][0]["label"]
                        == b["tasks"][task]["predictions"][0]["label"]
                    )


def test_a_registry_change_is_seen_by_every_process_within_one_poll(group, make_bundle) -> None:
    name = f"front-{group.mode}-{group.settings.decode_device}"
    with fresh(group.url, **AUTH) as client:
        assert register(client, make_bundle(name).to_bytes()).status_code == 201
        time.sleep(POLL + 0.3)
        for _ in range(6):
            assert client.get(f"/adapters/{name}").status_code == 200
            r = post_image(client, jpeg(), tasks=name)
            assert r.status_code == 200 and r.json()["tasks"] == [name], r.text
        assert client.delete(f"/adapters/{name}").status_code == 200
        time.sleep(POLL + 0.3)
        for _ in range(6):
            assert client.get(f"/adapters/{name}").status_code == 404
            r = post_image(client, jpeg(), tasks=name)
            assert r.status_code == 422 and "unknown task" in r.json()["error"]["message"]


def test_a_keys_limits_are_not_multiplied_by_the_processes(group, shared) -> None:
    _, keys = shared
    with fresh(group.url, Authorization=f"Bearer {keys['limited']}") as client:
        statuses = [post_image(client, jpeg()).status_code for _ in range(8)]
    assert set(statuses) <= {200, 429}
    if group.mode == "model-process":  # one bucket in the model process: exactly its burst
        assert statuses.count(200) == 2 and statuses[-1] == 429, statuses
    else:  # each replica holds half of the burst, spent whenever a request first reaches it
        assert 1 <= statuses.count(200) <= 2 and 429 in statuses, statuses


def _sample(text: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pattern = (
        rf"^{re.escape(name)}{{{re.escape(wanted)}}} (\S+)$" if labels else rf"^{re.escape(name)} (\S+)$"
    )
    found = re.findall(pattern, text, re.M)
    return float(found[0]) if found else 0.0


def test_metrics_are_one_view_of_every_process(group) -> None:
    with fresh(group.url) as client:
        before = _sample(client.get("/metrics").text, "memvit_requests_total", method="GET", route="/healthz",
                         status="200")  # fmt: skip
        for _ in range(10):
            assert client.get("/healthz").status_code == 200
        deadline = time.monotonic() + 5
        while True:
            scrapes = [client.get("/metrics").text for _ in range(4)]  # most likely both processes
            counts = [
                _sample(t, "memvit_requests_total", method="GET", route="/healthz", status="200")
                for t in scrapes
            ]
            if all(c == before + 10 for c in counts) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    assert counts == [before + 10] * 4  # every process's requests, each once
    for text in scrapes:
        assert _sample(text, "memvit_ready") == 1
        assert _sample(text, "memvit_gc_frozen_objects") > 100_000  # every process's loaded heap, frozen
        assert _sample(text, "memvit_batch_images_count") > 0  # the passes, wherever they ran
        assert text.count("# TYPE memvit_requests_total counter") == 1


def test_the_open_inference_protocol(group, single) -> None:
    import tritonclient.http as http

    image = jpeg((90, 20, 180))
    tensor = http.InferInput("IMAGE", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([image], dtype=object), binary_data=True)
    with http.InferenceServerClient(urlparse(group.url).netloc, network_timeout=30.0) as triton:
        assert triton.is_server_ready()
        got = triton.infer("base", [tensor]).as_numpy("base")
    with http.InferenceServerClient(urlparse(single).netloc, network_timeout=30.0) as triton:
        expected = triton.infer("base", [tensor]).as_numpy("base")
    assert np.allclose(got, expected, atol=1e-5)


def test_a_killed_process_is_answered_503_then_restarted(group) -> None:
    if group.mode != "model-process":
        pytest.skip("no model process in the replicas front end")
    os.kill(group.started("model"), signal.SIGKILL)
    with fresh(group.url) as client:
        started = time.monotonic()
        refused = post_image(client, jpeg())
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert time.monotonic() - started < 5  # answered, not left hanging
        group.wait_for_log("started model", count=2, timeout=30)
        deadline = time.monotonic() + 60
        while client.get("/readyz").status_code != 200 or post_image(client, jpeg()).status_code != 200:
            assert time.monotonic() < deadline, group.log()[-3000:]
            time.sleep(0.2)
        if group.settings.decode_device == "cpu":  # once is enough: an API process dies too
            os.kill(group.started("api-0"), signal.SIGKILL)
            group.wait_for_log("started api-0", count=2, timeout=30)
            statuses = [post_image(client, jpeg()).status_code for _ in range(4)]
            assert set(statuses) <= {200, 503} and 200 in statuses  # a new one may still be connecting


def test_a_restarting_replica_takes_no_traffic_until_it_can_answer(group) -> None:
    """A replica killed under traffic is restarted; while it loads, every request is answered by the
    other, never 503 "not ready" by the one loading (it listens once it can answer)."""
    if group.mode != "replicas":
        pytest.skip("the API processes of the model-process front end load nothing")
    answers: list[tuple[float, int]] = []  # (when, status); 0 for a connection that broke
    stop = threading.Event()

    def traffic() -> None:
        with fresh(group.url) as client:
            while not stop.is_set():
                try:
                    answers.append((time.monotonic(), post_image(client, jpeg()).status_code))
                except httpx.TransportError:
                    answers.append((time.monotonic(), 0))

    thread = threading.Thread(target=traffic)
    thread.start()
    try:
        time.sleep(0.5)
        killed = time.monotonic()
        os.kill(group.started("replica-1"), signal.SIGKILL)
        group.wait_for_log("started replica-1", count=2, timeout=60)
        group.wait_for_log("listening on port", count=3, timeout=120)  # the new one listens
        time.sleep(0.5)
    finally:
        stop.set()
        thread.join()
    statuses = [status for _, status in answers]
    assert set(statuses) <= {0, 200} and statuses.count(200) > 10, sorted(set(statuses))
    assert all(when - killed < 1 for when, status in answers if status == 0)  # only what the kill cut


def test_sigterm_stops_every_child(group) -> None:
    children = group.children()
    assert len(children) >= (3 if group.mode == "model-process" else 2)
    group.server.proc.send_signal(signal.SIGTERM)
    assert group.server.proc.wait(timeout=60) == 0
    deadline = time.monotonic() + 10
    while any(map(_alive, children)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if _alive(pid)]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
