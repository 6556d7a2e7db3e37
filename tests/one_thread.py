"""``one_torch_thread``: a test's tensor operations on one intra-op thread, the count put back after.

The training and stored-activation tests run thousands of operations on tiny tensors (a 32x32 ViT, a
few images a batch). Split across two threads, each operation pays a wake-up of the second thread
for microseconds of work, and on a machine whose cores are busy elsewhere that wait grows a
hundredfold: two 24-step runs took 9 s on two threads and 1.6 s on one (2 cores, load average 4).
The thread count may change how a float sum rounds, never what it computes; these tests compare runs
made in one process (or in subprocesses started with OMP_NUM_THREADS=1), or against a tolerance, so
nothing they prove depends on the count.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
