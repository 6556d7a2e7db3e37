"""Process-level settings entry points call: float32 on CUDA kept float32 (no TF32), nothing else touched;
how the host waits for the GPU (the driver's flags, and on a GPU the cores it leaves idle)."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref

import pytest
import torch

from memvit.memory_core import runtime
from memvit.memory_core.invariant.blocks import InvariantBlocks
from memvit.memory_core.runtime import cuda_host_waits, exact_float32, freeze_heap


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
        now = gc.get_freeze_count()  # frozen objects still die when their last reference goes
        assert now > 1000 and now <= frozen <= now * 1.01
        assert len(gc.get_objects()) < frozen  # what the collector still walks: what came since
    finally:
        gc.unfreeze()


class FakeDriver:
    """libcuda's three calls ``cuda_host_waits`` makes, recorded; ``fail``: the one that returns 1."""

    def __init__(self, fail: str | None = None) -> None:
        self.calls: list[tuple[str, object]] = []
        for name in ("cuInit", "cuDeviceGet", "cuDevicePrimaryCtxSetFlags_v2"):
            setattr(self, name, self._call(name, fail))

    def _call(self, name: str, fail: str | None):
        def call(*args):
            self.calls.append((name, args[-1]))  # the flag, the ordinal, cuInit's 0
            return 1 if name == fail else 0

        call.__name__ = name
        return call


def test_cuda_host_waits_set_the_primary_contexts_flags_through_the_driver(monkeypatch) -> None:
    driver = FakeDriver()
    monkeypatch.setattr(runtime.ctypes, "CDLL", lambda name: driver if name == "libcuda.so.1" else None)
    assert cuda_host_waits(torch.device("cuda:1"), "block")
    assert driver.calls == [("cuInit", 0), ("cuDeviceGet", 1), ("cuDevicePrimaryCtxSetFlags_v2", 0x4)]
    monkeypatch.setattr(runtime.ctypes, "CDLL", lambda name: FakeDriver(fail="cuDeviceGet"))
    with pytest.raises(RuntimeError, match="cuDeviceGet failed with status 1"):
        cuda_host_waits(torch.device("cuda"), "spin")


def test_cuda_host_waits_leave_auto_and_other_devices_alone(monkeypatch) -> None:
    loaded = []
    monkeypatch.setattr(runtime.ctypes, "CDLL", lambda name: loaded.append(name))
    assert not cuda_host_waits(torch.device("cpu"), "block")
    assert not cuda_host_waits(torch.device("cuda"), "auto")  # CUDA's own choice
    with pytest.raises(ValueError, match="auto, spin, yield, block"):
        cuda_host_waits(torch.device("cuda"), "busy")
    assert loaded == []


_BUSY_SHARE = """
import sys, time, torch
from memvit.memory_core.runtime import cuda_host_waits
cuda_host_waits(torch.device("cuda"), sys.argv[1])
torch.cuda._sleep(1_000_000)  # the context, and a first sleep
torch.cuda.synchronize()
began = time.perf_counter()
torch.cuda._sleep(100_000_000)
torch.cuda.synchronize()
cycles_per_s = 100_000_000 / (time.perf_counter() - began)
cpu, began = time.process_time(), time.perf_counter()
torch.cuda._sleep(int(0.3 * cycles_per_s))  # ~0.3 s of GPU work, the host waiting for it
torch.cuda.synchronize()
print((time.process_time() - cpu) / (time.perf_counter() - began))
"""


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_blocking_waits_leave_the_core_idle_while_the_gpu_works() -> None:
    """Each mode in a fresh process (the flags are set before its context): waiting 0.3 s for the GPU,
    a spinning host keeps its core busy, a blocking one sleeps."""
    share = {}
    for mode in ("spin", "block"):
        run = subprocess.run([sys.executable, "-c", _BUSY_SHARE, mode], capture_output=True, text=True,
                             timeout=120)  # fmt: skip
        assert run.returncode == 0, f"{mode}: {run.stderr.strip().splitlines()[-1:]}"
        share[mode] = float(run.stdout.strip().splitlines()[-1])
    assert share["spin"] > 0.7 and share["block"] < 0.2, share
