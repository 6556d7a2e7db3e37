"""The front end's parts without processes: images through the shared-memory wire, the metrics of
several processes merged into one view, and a replica's share of a key's limits."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from memvit.server.errors import RateLimitedError
from memvit.server.frontend.limits import ShareLimiter
from memvit.server.frontend.shared_metrics import merge
from memvit.server.frontend.shm_arena import Arena, Reader
from memvit.server.frontend.wire import pack, unpack
from memvit.server.inference.device_decode import Encoded
from memvit.server.tenancy.policy import Limits, Policy


@pytest.mark.parametrize("arena_size", [1 << 20, 64])  # in the arena; too small: inline
def test_images_cross_the_wire_as_they_were(arena_size) -> None:
    arena, reader = Arena(arena_size), Reader()
    try:
        batch = torch.randn(3, 3, 8, 8)
        payload, tickets = pack(batch, arena)
        assert len(tickets) == (1 if arena_size > batch.numel() * 4 else 0)
        assert torch.equal(unpack(payload, reader), batch)
        items = [torch.randn(3, 8, 8).to(torch.bfloat16), Encoded(b"\xff\xd8\xff jpeg", "a.jpg", 6)]
        payload, more = pack(items, arena)
        back = unpack(payload, reader)
        assert torch.equal(back[0], items[0]) and back[0].dtype == torch.bfloat16
        assert back[1] == items[1]
        del back  # the tensors view the arena: gone before it is closed
        for ticket in tickets + more:
            arena.free(ticket)
        assert arena.held == 0
    finally:
        reader.close()
        arena.close()


def _process(requests: int, ready: float, queue: float, version: float) -> str:
    r = CollectorRegistry()
    Counter("memvit_requests_total", "HTTP requests", ["route"], registry=r).labels("/classify").inc(requests)
    Histogram("memvit_batch_images", "images per pass", buckets=(1, 8), registry=r).observe(requests)
    Gauge("memvit_ready", "ready", registry=r).set(ready)
    Gauge("memvit_queue_images", "queued", registry=r).set(queue)
    Gauge("memvit_adapter_set_version", "version", registry=r).set(version)
    return generate_latest(r).decode()


def test_metrics_of_several_processes_are_one_view() -> None:
    text = merge([_process(2, 1, 5, 7), _process(3, 0, 1, 9)]).decode()
    assert 'memvit_requests_total{route="/classify"} 5.0' in text
    assert "memvit_batch_images_count 2.0" in text and "memvit_batch_images_sum 5.0" in text
    assert 'memvit_batch_images_bucket{le="8.0"} 2.0' in text
    assert "memvit_ready 0.0" in text  # ready only when every process is
    assert "memvit_queue_images 6.0" in text  # the queues add up
    assert "memvit_adapter_set_version 9.0" in text  # the newest registry
    assert text.count("# TYPE memvit_requests_total counter") == 1


def test_a_replica_holds_its_share_of_a_keys_limits() -> None:
    limiter = ShareLimiter(2)
    policy = Policy(limits=Limits(images_per_second=0.001, burst=4, requests_in_flight=3))
    tickets = [limiter.admit("acme", policy) for _ in range(2)]  # ceil(3 / 2) in flight here
    with pytest.raises(RateLimitedError):
        limiter.admit("acme", policy)
    tickets[0].charge(2)  # half the burst
    tickets[0].release()
    with pytest.raises(RateLimitedError):
        limiter.admit("acme", policy).charge(1)


def test_an_api_process_builds_its_service_without_touching_the_gpu(
    tiny_weights, tmp_path, monkeypatch
) -> None:
    """An API process of a model on CUDA that decodes JPEGs there only checks uploads: it creates no
    CUDA context (each would hold ~500 MiB of the GPU's memory for nothing)."""
    from memvit.memory_core import MemoryViT
    from memvit.server.frontend.api_process import _build
    from memvit.server.frontend.remote import ModelLink
    from memvit.server.inference.device_decode import JpegCheck
    from memvit.server.settings import Settings
    from tests.server.inference.test_device_decode import jpeg, photo

    def no_gpu(*args, **kwargs):
        raise AssertionError("an API process touched CUDA")

    monkeypatch.setattr(torch.cuda, "_lazy_init", no_gpu)
    engine = MemoryViT.from_timm(weights=tiny_weights)
    info = {
        "labels": engine.labels, "spec": engine.spec, "source": engine.source, "device": "cuda:0",
        "dtype": "float32", "data_config": engine.data_config(), "in_chans": 3,
        "num_classes": int(engine.base.num_classes), "max_tasks": 64,
    }  # fmt: skip
    settings = Settings(weights=tiny_weights, adapter_store=tmp_path / "store", decode_device="auto")
    service = _build(settings, ModelLink(tmp_path / "model.sock"), None, info)
    try:
        assert isinstance(service.pipeline.decoder, JpegCheck)  # JPEGs go to the model's device
        assert isinstance(service.pipeline.decoder(jpeg(photo(0)), "a.jpg"), Encoded)
        assert not torch.cuda.is_initialized()
    finally:
        service.decode_pool.shutdown()


def test_an_answer_crosses_the_link_with_its_labels_by_key() -> None:
    import asyncio

    import numpy as np

    from memvit.server.frontend.labels import LabelCache, LabelKeys
    from memvit.server.frontend.remote import answer_from_wire, answer_to_wire
    from memvit.server.inference.answers import Answer

    base, cats, dogs_old, dogs = ("b0", "b1"), ("cat", "lion"), ("dog", "wolf"), ("dog", "wolf", "fox")
    answer = Answer(
        ("base", "cats", "dogs"), np.array([2, 2, 3]), np.random.rand(2, 3, 2).astype(np.float32),
        np.random.randint(0, 2, (2, 3, 2)), np.random.rand(2, 3, 3).astype(np.float32),
        (base, cats, dogs), 7, 2, {"queue": 0.5},
    )  # fmt: skip
    keys = LabelKeys()
    wire = answer_to_wire(answer, keys.cached())
    asked: list = []

    async def ask(missing):
        asked.append(missing)
        return keys.labels(missing)

    catalog = {"cats": cats, "dogs": dogs_old}  # the replica has not read the replacement of "dogs"
    cache = LabelCache(base, catalog.get, ask)
    back = answer_from_wire(wire, asyncio.run(cache.resolve(wire[0], wire[6])))
    assert back.labels == (base, cats, dogs) and len(asked) == 1  # asked for dogs' alone, once
    for name in ("classes", "probs", "index", "logits"):
        assert np.array_equal(getattr(back, name), getattr(answer, name))
    assert (back.tasks, back.version, back.registered, back.stages) == (answer.tasks, 7, 2, {"queue": 0.5})
    asyncio.run(cache.resolve(wire[0], wire[6]))
    assert len(asked) == 1  # known now
