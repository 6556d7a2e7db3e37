"""A model batch keeps to its thread (benchmarks/batch_cpu.py): with two intra-op threads, a batch of
five small images, top 1 and top 5, forks no parallel region, so no libgomp worker spins beside it
(the code before server/inference/host_answers.py measured 1.99x the thread's CPU in the process)."""

from __future__ import annotations

import pytest

from benchmarks.batch_cpu import run


@pytest.mark.parametrize("top_k", [1, 5])
def test_a_small_batch_uses_no_cpu_beside_its_own_thread(top_k: int) -> None:
    got = run(batch=5, top_k=top_k, batches=200, threads=2, then=None)
    # Another thread's CPU would be the intra-op pool's: it spins through the loop after one fork.
    assert got["process"] <= 1.15 * got["thread"] + 0.02, got
