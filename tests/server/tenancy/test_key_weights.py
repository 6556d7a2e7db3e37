"""A key's weight from the keys file, on a real server: it reaches the fused passes (the passes take
its images in proportion to it) and the decoders (each key's images decoded in turn, by weight)."""

from __future__ import annotations

import time

import httpx
import pytest

from memvit.server.http.app import create_app
from memvit.server.settings import Settings
from memvit.server.tenancy.key_file import add_key
from memvit.server.tenancy.policy import Policy
from tests.server.conftest import TOKEN, free_port, running_server
from tests.server.test_api import jpeg


def test_weights_from_the_keys_file_reach_the_fused_passes(tiny_weights, store, tmp_path) -> None:
    """Two keys' requests queued while a pass is held: the passes after it take 3 of one's images
    for each of the other's, as their weights (1 and 3) say, whatever order they arrived in."""
    import asyncio
    import threading

    keys_file = tmp_path / "keys.json"
    one = add_key(keys_file, "one", ["*"], read=True, write=False)
    three = add_key(keys_file, "three", ["*"], read=True, write=False, policy=Policy(weight=3))
    settings = Settings(
        _env_file=None, weights=tiny_weights, adapter_store=store, port=free_port(), admin_token=TOKEN,
        api_keys_file=keys_file, max_wait_ms=0, max_batch=4, usage_log=False,
    )  # fmt: skip
    app = create_app(settings)
    colours = {"one": (250, 10, 10), "three": (10, 10, 250)}
    with running_server(settings, app) as url:
        engine_loop = app.state.memvit.service.engine_loop
        runner = engine_loop.runner
        held, passes = threading.Event(), []
        decode = runner.decode

        def recording(items, *lane):
            passes.append([float(item[0, 0, 0]) for item in items])  # the red channel tells the keys apart
            if len(passes) == 1:
                held.wait(30)
            return decode(items, *lane)

        runner.decode = recording

        async def clients() -> None:
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:

                def send(key: str, who: str):
                    files = {"image": ("i.jpg", jpeg(colours[who]), "image/jpeg")}
                    return http.post("/classify", files=files, headers={"Authorization": f"Bearer {key}"})

                first = asyncio.create_task(send(one, "one"))
                while not passes:
                    await asyncio.sleep(0.01)
                rest = [
                    asyncio.create_task(send(k, w))
                    for _ in range(8)
                    for k, w in ((one, "one"), (three, "three"))
                ]
                deadline = time.monotonic() + 20
                while engine_loop._queue.waiting < 16 and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)  # every request decoded and queued behind the held pass
                held.set()
                assert all(r.status_code == 200 for r in await asyncio.gather(first, *rest))

        asyncio.run(clients())
    red = max(value for p in passes for value in p)
    whose = [["one" if value == red else "three" for value in p] for p in passes[1:]]
    assert [sorted(p) for p in whose[:2]] == [["one", "three", "three", "three"]] * 2, whose


@pytest.mark.parametrize("fair", [True, False], ids=["fair", "by-arrival"])
def test_a_keys_images_are_decoded_in_turn(tiny_weights, store, tmp_path, fair) -> None:
    """One decode thread: key A's six images wait to be decoded, then key B's one arrives. Fair, B's
    is decoded third; by arrival, last."""
    import asyncio
    import threading

    keys_file = tmp_path / "keys.json"
    keys = {who: add_key(keys_file, who, ["*"], read=True, write=False) for who in ("a", "b")}
    settings = Settings(
        _env_file=None, weights=tiny_weights, adapter_store=store, port=free_port(), admin_token=TOKEN,
        api_keys_file=keys_file, decode_workers=1, fair_batching=fair, usage_log=False,
    )  # fmt: skip
    app = create_app(settings)
    with running_server(settings, app) as url:
        pipeline = app.state.memvit.service.pipeline
        decode, held, order = pipeline.decoder, threading.Event(), []

        def recording(data: bytes, name: str = "image"):
            order.append(name)
            if len(order) == 1:
                held.wait(30)
            return decode(data, name)

        pipeline.decoder = recording

        def waiting() -> int:  # decodes not yet started
            return pipeline.decode_order.waiting if fair else pipeline.decode_pool._work_queue.qsize()

        async def clients() -> None:
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:

                def send(who: str, n: int):
                    files = [("image", (f"{who}{i}.jpg", jpeg(), "image/jpeg")) for i in range(n)]
                    return http.post(
                        "/classify", files=files, headers={"Authorization": f"Bearer {keys[who]}"}
                    )

                a = asyncio.create_task(send("a", 6))
                deadline = time.monotonic() + 20
                while waiting() < 5 and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                b = asyncio.create_task(send("b", 1))
                while waiting() < 6 and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                held.set()
                assert [r.status_code for r in await asyncio.gather(a, b)] == [200, 200]

        asyncio.run(clients())
    assert order[0] == "a0.jpg" and len(order) == 7
    # Fair: after the one decoding and A's next (the two keys level, A's waiting longer); else last.
    assert order.index("b0.jpg") == (2 if fair else 6), order
