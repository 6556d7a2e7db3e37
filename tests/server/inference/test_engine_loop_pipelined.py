"""The engine loop on a pipelined device (depth 3, as on a GPU; server/inference/engine_loop.py): a
batch forms when a decoder is free to take it, so the requests of one decoder cycle make one batch
and a light key's request takes the next; with two lanes, two decode threads decode at once."""

from __future__ import annotations

import threading
import time

import torch

from memvit.memory_core import LiveAdapters
from memvit.server.inference.device_runner import DeviceRunner
from memvit.server.inference.engine_loop import EngineLoop
from memvit.server.telemetry.metrics import Metrics
from tests.conftest import images
from tests.server.inference.test_engine_loop import engine_loop, submit


def _held_first_decode(loop: EngineLoop) -> tuple[threading.Event, threading.Event]:
    """The loop's first decode waits for ``release`` (a stand-in for a decoder that takes a while);
    ``started`` is set once it has begun. Later decodes run at once."""
    started, release, decode = threading.Event(), threading.Event(), loop.runner.decode

    def held(items, *lane):
        if not started.is_set():
            started.set()
            release.wait(10)
        return decode(items, *lane)

    loop.runner.decode = held
    return started, release


def test_on_a_pipelined_device_a_batch_forms_when_the_decoder_is_free(engine) -> None:
    """With three batches in flight, the requests that arrive while a batch decodes make one batch, not
    several formed ahead one request each (each paying the decoder's and the pass's fixed costs)."""
    loop, sizes = engine_loop(LiveAdapters(engine), depth=3)
    started, release = _held_first_decode(loop)
    x = images(engine, 7)
    loop.start()
    try:
        first = submit(loop, x[:1])
        assert started.wait(10)
        rest = [submit(loop, x[i : i + 1]) for i in range(1, 7)]
        time.sleep(0.2)  # a batcher that forms ahead has formed its batches by now
        release.set()
        answers = [f.result(10) for f in [first, *rest]]
    finally:
        loop.stop()
    assert [s for s, _ in sizes] == [1, 6]
    for i, answer in enumerate(answers):
        torch.testing.assert_close(torch.from_numpy(answer.task_logits(0)), engine(x[i : i + 1]).base)


def test_on_a_pipelined_device_a_light_key_takes_the_next_batch(engine) -> None:
    """A key's backlog is not formed into batches ahead of time: a light key's request that arrives
    while the flood's first batch decodes is in the next batch."""
    loop = EngineLoop(LiveAdapters(engine), DeviceRunner(engine), max_batch=4, max_wait=0, max_queue=1000,
                      metrics=Metrics(), depth=3)  # fmt: skip
    started, release = _held_first_decode(loop)
    flows: list[list[str]] = []
    decode = loop.runner.decode

    def recording(items, *lane):
        flows.append(["light" if float(item[0, 0, 0]) == 100.0 else "heavy" for item in items])
        return decode(items, *lane)

    loop.runner.decode = recording
    x = images(engine, 13)
    x[12, 0, 0, 0] = 100.0
    heavy = [submit(loop, x[i : i + 1], flow="heavy") for i in range(12)]
    loop.start()
    try:
        assert started.wait(10)
        light = submit(loop, x[12:], flow="light")
        time.sleep(0.2)  # a batcher that forms ahead has formed the flood's next batches by now
        release.set()
        for future in [*heavy, light]:
            future.result(10)
    finally:
        loop.stop()
    assert flows[0] == ["heavy"] * 4 and "light" in flows[1], flows


def test_two_decode_threads_decode_two_batches_at_once(engine) -> None:
    """With two lanes, a second decode thread forms and decodes a batch while the first one's decode
    is still running, each on its own lane; every answer is the image's own."""
    loop, sizes = engine_loop(LiveAdapters(engine), depth=3, lanes=2)
    started, release = _held_first_decode(loop)
    lanes: list[int] = []
    decode = loop.runner.decode
    loop.runner.decode = lambda items, lane=0: lanes.append(lane) or decode(items, lane)
    x = images(engine, 3)
    loop.start()
    try:
        first = submit(loop, x[:1])
        assert started.wait(10)
        second = submit(loop, x[1:])
        answer = second.result(10)  # answered while the first batch is still decoding
        assert not first.done()
        release.set()
        alone = first.result(10)
    finally:
        loop.stop()
    assert sorted(lanes) == [0, 1] and [s for s, _ in sizes] == [2, 1]
    torch.testing.assert_close(torch.from_numpy(answer.task_logits(0)), engine(x[1:]).base)
    torch.testing.assert_close(torch.from_numpy(alone.task_logits(0)), engine(x[:1]).base)
