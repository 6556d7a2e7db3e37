"""``narrow``/``widen`` (server/inference/intra_op.py): the calling thread's operations on one intra-op
thread, no other thread's, and the batch's preprocessing and answers the same bits as with torch's threads."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from memvit.server.inference import intra_op
from memvit.server.inference.answers import BatchAnswers, Want
from memvit.server.inference.intra_op import narrow, widen

needs_threads = pytest.mark.skipif(
    intra_op._GOMP is None or torch.get_num_threads() < 2, reason="no OpenMP runtime, or one thread"
)


@needs_threads
def test_it_narrows_the_calling_thread_alone_and_restores_it() -> None:
    before = torch.get_num_threads()
    inside, other = threading.Event(), []

    def elsewhere() -> None:
        inside.wait(10)
        other.append(torch.get_num_threads())

    thread = threading.Thread(target=elsewhere)
    thread.start()
    threads = narrow()
    assert threads == before and torch.get_num_threads() == 1
    inside.set()
    thread.join(10)
    widen(threads)
    assert other == [before]  # another thread, meanwhile
    assert torch.get_num_threads() == before


@needs_threads
def test_large_batches_answers_and_preprocessing_are_the_same_bits_on_one_thread(setup_engine) -> None:
    engine, adapters = setup_engine
    torch.manual_seed(0)
    x = torch.randn(64, 3, 32, 32)
    out = engine(x, adapters)
    wants = [Want(i, i + 1, 3, True) for i in range(64)]

    def answered() -> list:
        batch = BatchAnswers(out, engine.labels, wants)
        batch.wait()
        return [batch.cut(w, None, 1, 1) for w in wants]

    pictures = torch.randint(0, 256, (64, 3, 300, 200), dtype=torch.uint8)

    def resized() -> torch.Tensor:  # the preprocessing's operations, at a size torch splits
        batch = torch.stack(list(pictures))
        batch = torch._C._nn._upsample_bicubic2d_aa(batch, [240, 160], False, None)
        return torch.addcmul(torch.zeros(3, 1, 1), batch[:, :, 8:232, :].float(), torch.ones(3, 1, 1))

    many = answered()
    before = narrow()
    one, alone = answered(), resized()
    widen(before)
    assert torch.equal(alone, resized())
    for a, b in zip(many, one, strict=True):
        for field in ("probs", "index", "logits", "classes"):
            assert np.array_equal(getattr(a, field), getattr(b, field))


@pytest.fixture(scope="module")
def setup_engine():
    from memvit.memory_core import LiveAdapters
    from tests.conftest import random_adapter, tiny_engine

    engine = tiny_engine()
    live = LiveAdapters(engine)
    live.replace_all([random_adapter(n, engine, m=2, classes=c) for n, c in (("a", 3), ("b", 9), ("c", 700))])
    return engine, live.current
