"""The routing key read in Ray's proxy (server/ray/affinity.py) and the placement computed from it
(server/ray/router.py), on their own. The real thing, requests landing on the replica that holds
their adapter, is in test_ray_serve.py."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from memvit.memory_core import NAME_PATTERN
from memvit.server.ray.affinity import KEY_HEADER, AdapterAffinityMiddleware, key_from_request
from memvit.server.ray.affinity import NAME_PATTERN as PROXY_NAME_PATTERN


@pytest.mark.parametrize(
    ("path", "query", "key"),
    [
        ("/classify", b"tasks=flowers", "flowers"),
        ("/classify", b"tasks=flowers,cars&top_k=3", "flowers"),
        ("/classify", b"top_k=1&tasks=base&tasks=%20cars%20,flowers", "cars"),  # base is no adapter
        ("/classify", b"tasks=base", None),
        ("/classify", b"tasks=,,", None),
        ("/classify", b"", None),  # no filter: every task, any replica
        ("/classify", b"tasks=Not_A_Name,flowers", None),  # the replica answers its 422
        ("/memvit/classify", b"tasks=cars", "cars"),  # behind an application's route prefix
        ("/v2/models/flowers/infer", b"", "flowers"),
        ("/v2/models/flowers/versions/1/infer", b"", "flowers"),
        ("/v2/models/base/infer", b"", None),  # the fused model: its outputs are in the body
        ("/v2/models/flowers", b"", None),
        ("/adapters/flowers", b"", None),
        ("/classify/other", b"tasks=flowers", None),
    ],
)
def test_the_key_is_the_first_adapter_the_request_names(path: str, query: bytes, key: str | None) -> None:
    assert key_from_request(path, query) == key


def test_the_proxys_name_pattern_is_the_engines() -> None:
    assert PROXY_NAME_PATTERN.pattern == NAME_PATTERN.pattern


def _headers_seen(url: str, headers: dict[str, str] | None = None) -> dict[str, str]:
    seen: dict[str, str] = {}

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.update({k.decode(): v.decode() for k, v in scope["headers"]})
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def run() -> None:
        transport = httpx.ASGITransport(app=AdapterAffinityMiddleware(app))
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            await client.post(url, content=b"x", headers=headers)

    asyncio.run(run())
    return seen


def test_the_middleware_adds_the_key_only_when_the_request_has_none() -> None:
    assert _headers_seen("/classify?tasks=cars,flowers")[KEY_HEADER.decode()] == "cars"
    assert KEY_HEADER.decode() not in _headers_seen("/classify")
    # The client's own header wins, in either spelling Ray reads; blank means no key at all.
    seen = _headers_seen("/classify?tasks=cars", {"serve-multiplexed-model-id": "x"})
    assert seen["serve-multiplexed-model-id"] == "x" and KEY_HEADER.decode() not in seen
    seen = _headers_seen("/classify?tasks=cars", {"serve_multiplexed_model_id": ""})
    assert [k for k in seen if k.replace("-", "_") == KEY_HEADER.decode()] == [KEY_HEADER.decode()]
    assert seen[KEY_HEADER.decode()] == ""


ray_router = pytest.importorskip("memvit.server.ray.router", reason="the router needs the ray extra")


def test_rendezvous_gives_each_replica_a_slice_and_moves_little_when_one_goes() -> None:
    keys = [f"adapter-{i}" for i in range(600)]
    replicas = ["r-a", "r-b", "r-c"]
    home = {k: ray_router.rendezvous_order(k, replicas)[0] for k in keys}
    assert home == {k: ray_router.rendezvous_order(k, list(reversed(replicas)))[0] for k in keys}
    counts = Counter(home.values())
    assert set(counts) == set(replicas) and min(counts.values()) > 150, counts
    # r-c goes: only its keys move, each to its second choice; the others stay where they are.
    after = {k: ray_router.rendezvous_order(k, ["r-a", "r-b"])[0] for k in keys}
    assert all(after[k] == home[k] for k in keys if home[k] != "r-c")
    assert all(after[k] == ray_router.rendezvous_order(k, replicas)[1] for k in keys if home[k] == "r-c")


def test_a_busy_home_passes_its_requests_to_the_next_replica() -> None:
    key = "adapter-7"
    home, second, third = ray_router.rendezvous_order(key, ["r-a", "r-b", "r-c"])
    idle = {"r-a": 0, "r-b": 0, "r-c": 0}
    assert ray_router.placement(key, idle, 1.25) == [home, second, third]
    # Within load_factor x the fair share (of those in flight plus this one): still the home.
    assert ray_router.placement(key, {**idle, home: 3, second: 2, third: 2}, 1.25)[0] == home
    # Past it: the replicas within the bound first, each group in the key's order.
    assert ray_router.placement(key, {**idle, home: 6, second: 1, third: 1}, 1.25) == [second, third, home]
    assert ray_router.placement(key, {**idle, home: 6, second: 6, third: 0}, 1.25) == [third, home, second]
    # A large factor is pure affinity.
    assert ray_router.placement(key, {**idle, home: 50}, 100.0)[0] == home


def test_the_router_refuses_settings_it_does_not_know() -> None:
    router = object.__new__(ray_router.AdapterAffinityRouter)  # initialize_state only: no Serve
    router.initialize_state()
    assert router.adapter_affinity is True and router.load_factor == 1.25
    router.initialize_state(adapter_affinity=False, load_factor=2)
    assert router.adapter_affinity is False and router.load_factor == 2.0
    for bad, match in [
        ({"adapter_affinity": "no"}, "adapter_affinity must be"),
        ({"load_factor": 0.5}, "load_factor must be"),
        ({"load_factor": "2"}, "load_factor must be"),
        ({"patience_s": -1}, "patience_s must be"),
        ({"hot_share": 1.5}, "hot_share must be"),
        ({"hot_share": True}, "hot_share must be"),
        ({"affinity": True}, "unknown request_router_kwargs"),
    ]:
        with pytest.raises(ray_router.AffinityConfigError, match=match):
            router.initialize_state(**bad)


def test_a_key_is_hot_while_it_holds_its_share_of_the_recent_requests() -> None:
    hot = ray_router.HotKeys(0.25, window=8)
    assert hot.observe("a") is True  # 1 of 1
    assert [hot.observe(k) for k in "bcdefgh"] == [True, True, True, False, False, False, False]
    assert hot.observe("a") is False  # the window is full: the first "a" leaves as this one comes, 1 of 8
    assert [hot.observe("z") for _ in range(3)] == [False, True, True]
    assert ray_router.HotKeys(0.0).observe("a") is False  # 0 turns it off


def test_a_hot_key_takes_the_less_loaded_of_its_two_homes() -> None:
    key = "hot-adapter"
    home, second, third = ray_router.rendezvous_order(key, ["r-a", "r-b", "r-c"])
    idle = {"r-a": 0, "r-b": 0, "r-c": 0}
    assert ray_router.hot_placement(key, idle, 1.25) == [home, second, third]  # a tie: the home
    assert ray_router.hot_placement(key, {**idle, home: 3, second: 1}, 1.25)[0] == second
    # One more in flight is within the slack (a completion not yet counted): still the home.
    assert ray_router.hot_placement(key, {**idle, home: 2, second: 1}, 1.25)[0] == home
    assert ray_router.hot_placement(key, {**idle, home: 1, second: 3}, 1.25)[0] == home
    # Never a third replica first, however idle: the key stays resident on two.
    assert ray_router.hot_placement(key, {**idle, home: 4, second: 4}, 100.0)[0] == home
