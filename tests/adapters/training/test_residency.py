"""mincore through ctypes (adapters/training/residency.py): pages never read are not resident, pages
read are, on a real file mapping."""

from __future__ import annotations

import mmap

import numpy as np

from memvit.adapters.training.residency import all_resident, resident_pages


def test_pages_are_resident_once_read_and_not_before(tmp_path) -> None:
    n, page = 1024, mmap.PAGESIZE
    path = tmp_path / "sparse.bin"
    with open(path, "wb") as f:
        f.truncate(n * page)  # a hole: nothing of it in the page cache yet
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    mapping.madvise(mmap.MADV_RANDOM)  # no read-around: a fault brings in its own page only
    array = np.frombuffer(mapping, np.uint8)
    address = array.ctypes.data
    pages = resident_pages(address, n * page)
    assert pages is not None and len(pages) == n and not any(b & 1 for b in pages)
    assert not all_resident(address, n * page)
    int(array[100 * page : 102 * page : page].sum())  # read pages 100 and 101
    assert all_resident(address + 100 * page, 2 * page)
    assert not all_resident(address + 100 * page, 3 * page)  # 102 was not read
    assert not any(b & 1 for b in resident_pages(address + 512 * page, 512 * page))
    del array
    mapping.close()
