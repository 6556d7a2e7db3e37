"""``one_torch_thread``: a test's tensor operations on one intra-op thread, the count put back after.

The training and stored-activation tests run thousands of operations on tiny tensors (a 32x32 ViT, a
few images a batch). Split across two threads, each operation pays a wake-up of the second thread
for microseconds of work, and on a machine whose cores are busy elsewhere that wait grows a
hundredfold: a 24-step run took 9 s on two threads and 1.6 s on one. One thread computes the same
values (the tests compare runs within one process, or against a tolerance), so nothing they prove
depends on the count.
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
