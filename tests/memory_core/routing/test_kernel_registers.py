"""The Triton kernels' tiles (memory_core/routing/kernel_tiles.py) fit an H100's or H200's registers.

Each tile the launchers choose is compiled for sm_90 by Triton's own compiler and its PTX assembled
by the ptxas Triton ships (``ptxas -v``; benchmarks/kernel_registers.py, in processes of its own):
neither needs a GPU. The installed Triton's allocation: 3.8.0 here, which differs from the GPU
host's 3.6.0 (checked with ``--triton-python``, RESULTS §1.9). A tile whose values do not fit is
spilled to local memory, which every step of the kernel's loops then reads back; the tests hold
every choice to zero bytes spilled, and show that the tiles used before spilled (so that they can
fail).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from benchmarks.kernel_registers import attention_job, compile_jobs, head_jobs
from memvit.memory_core.routing import kernel_tiles, triton_kernels

pytestmark = pytest.mark.skipif(not triton_kernels.available(), reason="Triton is not installed")

# (R, d, dtype): the all-tasks pass (64 rows at 64 features: DeiT-Tiny's and ViT-B/16's heads), a
# routed pass (16 rows), 128-feature heads (32 rows), float16, float32 (16 rows, CUDA-core products).
ATTENTION_SHAPES = [
    (1000, 64, torch.bfloat16),
    (8, 64, torch.bfloat16),
    (1000, 128, torch.bfloat16),
    (1000, 64, torch.float16),
    (1000, 64, torch.float32),
    (1000, 128, torch.float32),
]
HEAD_SHAPES = [(100, 768), (1000, 192), (10, 768)]  # (classes, features)


def _jobs() -> dict[str, list[tuple]]:
    jobs = {f"attention {R} {d} {dtype}": [attention_job(R, d, dtype)] for R, d, dtype in ATTENTION_SHAPES}
    for d in (64, 128):
        jobs[f"one row {d}"] = [attention_job(1000, d, torch.bfloat16, block_rows=1)]
    jobs["wide"] = [attention_job(1000, 64, torch.bfloat16, tiles="wide")]
    for d in (64, 128):  # the GPU suite's try: 16-row tiles throughout, 64-row tiles on 16 warps
        jobs[f"narrow {d}"] = [attention_job(1000, d, torch.bfloat16, tiles="narrow")]
        jobs[f"deep {d}"] = [attention_job(1000, d, torch.bfloat16, tiles="deep")]
    for C, D in HEAD_SHAPES:
        for dtype in (torch.bfloat16, torch.float32):
            jobs[f"heads {C} {D} {dtype}"] = head_jobs(C, D, dtype)
    return jobs


@pytest.fixture(scope="module")
def spills() -> dict[str, list[tuple[int, int]]]:
    """Every job's (bytes spilled per thread, registers), compiled by two processes (~12 s)."""
    jobs = _jobs()
    flat = [job for group in jobs.values() for job in group]
    with ThreadPoolExecutor(2) as pool:
        halves = list(pool.map(compile_jobs, [flat[0::2], flat[1::2]]))
    if any(half["results"] is None for half in halves):
        pytest.skip("this Triton ships no ptxas")
    results: list = [None] * len(flat)
    results[0::2], results[1::2] = (half["results"] for half in halves)
    out, i = {}, 0
    for name, group in jobs.items():
        out[name] = [tuple(r) for r in results[i : i + len(group)]]
        i += len(group)
    return out


@pytest.mark.parametrize("R, d, dtype", ATTENTION_SHAPES)
def test_the_attention_kernels_tiles_spill_nothing(spills, R, d, dtype) -> None:
    ((spilled, registers),) = spills[f"attention {R} {d} {dtype}"]
    assert spilled == 0, f"{spilled} bytes spilled per thread ({registers} registers)"


@pytest.mark.parametrize("d", [64, 128])
def test_the_batch_invariant_modes_one_row_programs_spill_nothing(spills, d) -> None:
    assert spills[f"one row {d}"][0][0] == 0


@pytest.mark.parametrize("d", [64, 128])
def test_the_tiles_the_gpu_suite_tries_spill_nothing(spills, d) -> None:
    assert attention_job(1000, d, torch.bfloat16, tiles="narrow")[1]["BLOCK_R"] == 16
    assert attention_job(1000, 64, torch.bfloat16, tiles="deep")[3] == 16  # warps
    assert spills[f"narrow {d}"][0][0] == 0 and spills[f"deep {d}"][0][0] == 0


def test_the_tiles_before_spilled(spills) -> None:
    """What the registers' tiles replaced: the (64 rows, 8 memory positions, 64 features) float32
    products of the all-tasks pass, 13 KB per thread in local memory on sm_90 with Triton 3.8
    (2.7 KB with the GPU host's 3.6)."""
    assert kernel_tiles.TILES == "registers"
    assert spills["wide"][0][0] > 4096


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("C, D", HEAD_SHAPES)
def test_the_heads_kernels_tiles_spill_nothing(spills, C, D, dtype) -> None:
    assert [spilled for spilled, _ in spills[f"heads {C} {D} {dtype}"]] == [0, 0]
