"""The front end's parts without processes: images through the shared-memory wire, the metrics of
several processes merged into one view, and a replica's share of a key's limits."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from memvit.server.device_decode import Encoded
from memvit.server.errors import RateLimitedError
from memvit.server.frontend.limits import ShareLimiter
from memvit.server.frontend.shared_metrics import merge
from memvit.server.frontend.wire import pack, unpack
from memvit.server.policy import Limits, Policy
from memvit.server.shm_arena import Arena, Reader


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
