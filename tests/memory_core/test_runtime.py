"""Process-level settings entry points call: float32 on CUDA kept float32 (no TF32), nothing else touched."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from memvit.memory_core.invariant.blocks import InvariantBlocks
from memvit.memory_core.runtime import exact_float32, freeze_heap


@pytest.fixture
def tf32_on():
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


def test_float32_on_cuda_turns_tf32_off(tf32_on) -> None:
    # The flags are process-wide and settable without a GPU: what the server does when it builds its engine.
    assert exact_float32(torch.device("cuda"), torch.float32)
    assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32


@pytest.mark.parametrize(("device", "dtype"), [("cpu", torch.float32), ("cuda", torch.bfloat16)])
def test_other_passes_leave_tf32_alone(tf32_on, device: str, dtype: torch.dtype) -> None:
    assert not exact_float32(torch.device(device), dtype)
    assert torch.backends.cudnn.allow_tf32 and torch.backends.cuda.matmul.allow_tf32


def test_invariant_blocks_in_float32_on_cuda_keep_the_token_rows_blocked() -> None:
    # Measured on an H200: float32 did not hold with the per-token layers whole (benchmarks/RESULTS.md §1.6).
    fp32 = InvariantBlocks.for_device(torch.device("cuda"), torch.float32)
    bf16 = InvariantBlocks.for_device(torch.device("cuda"), torch.bfloat16)
    assert fp32.rows is not None and fp32.images is not None
    assert bf16.rows is None and bf16.images is None


def test_invariant_blocks_on_cuda_tile_the_triton_attention_on_16_rows() -> None:
    # Measured on an H200 (invariance step): a fixed 16-row tile held on base, routed and all-tasks
    # passes in both dtypes, and lifted bf16's all-tasks pass to 0.95-0.96 of the default mode.
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert InvariantBlocks.for_device(torch.device("cuda"), dtype).kernel_rows == 16
    # On the CPU the kernels are torch's (Triton only through its interpreter): one row per program.
    assert InvariantBlocks.for_device(torch.device("cpu"), torch.float32).kernel_rows == 1


def test_the_heap_is_frozen_after_one_collection() -> None:
    """Garbage in cycles is collected first (frozen, it would never be); what is alive is frozen, so a
    full collection then walks only what came since."""

    class Node:
        pass

    cycle = Node()
    cycle.me = cycle
    gone = weakref.ref(cycle)
    del cycle
    assert gone() is not None  # a cycle: only the collector frees it
    try:
        frozen = freeze_heap()
        assert gone() is None
        assert frozen == gc.get_freeze_count() > 1000
        assert len(gc.get_objects()) < frozen  # what the collector still walks: what came since
    finally:
        gc.unfreeze()
