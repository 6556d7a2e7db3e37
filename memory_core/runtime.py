"""Process-level settings for entry points: malloc tuning for CPU inference, float32 kept float32 on
CUDA, how the host waits for the GPU, the start-up heap frozen out of the garbage collector's reach.

glibc serves allocations above a (dynamic) threshold with fresh ``mmap`` pages and returns them on
free, so every large activation of a pass page-faults its way into existence again. The fused pass
allocates activations slightly larger than the base pass's, which lands them on the wrong side of
that threshold often enough to cost several percent on small models. Pinning the thresholds high
keeps freed activations in the heap for the next pass, as jemalloc or tcmalloc would (PyTorch's CPU
performance guide recommends either). It is a process-wide setting, so only entry points (the CLI,
the server, benchmarks) call it, never library code on import.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging

import torch

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def tune_malloc(threshold: int = 1 << 30) -> bool:
    """Keep allocations under ``threshold`` bytes in glibc's heap. Returns False where not glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, threshold) == 1 and mallopt(_M_TRIM_THRESHOLD, 2 * threshold) == 1
    log.info("glibc malloc thresholds %s", "set" if ok else "not set")
    return ok


def exact_float32(device: torch.device, dtype: torch.dtype) -> bool:
    """A float32 pass on CUDA in float32 throughout: no TF32 convolutions (cuDNN's default) or products.

    With TF32 on, the GPU suite's server step (DeiT-Tiny float32 under load, JPEGs decoded and
    preprocessed on the device in batches) put 1,770 of 4,217 answers beyond 1e-3 of the same image's
    answer alone; with it off, 0 of 58,074 (benchmarks/RESULTS.md §3.15). An answer must not depend on
    its neighbours, and the products already run in float32 (PyTorch's default), so this costs ~nothing.
    Process-wide, so only entry points (the server) call it. Returns whether it set anything.
    """
    if device.type != "cuda" or dtype != torch.float32:
        return False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    log.info("float32 on CUDA: TF32 convolutions and products off (answers independent of the batch)")
    return True


# CUDA's primary-context scheduling flags (cuda.h CUctx_flags): how a host thread waits for the device
CUDA_WAITS = {"spin": 0x1, "yield": 0x2, "block": 0x4}


def cuda_host_waits(device: torch.device, mode: str) -> bool:
    """How this process's threads wait for the GPU in a synchronize: ``spin`` (a core busy until the
    work is done), ``yield``, or ``block`` (asleep until woken); ``auto`` leaves CUDA's default, which
    spins while the process has fewer CUDA contexts than the host has cores.

    A serving process waits in several threads at once: each decode thread for nvJPEG (torchvision
    synchronises its stream before and after every batch) and the collector for each pass's answers,
    milliseconds each. Spinning, every such wait holds a core the API processes and the other engine
    threads could use (the model process spent 0.63-0.85 ms of CPU an image on the H200 host, its
    collector busy 0.14-0.26 of the wall: RESULTS §3.16). Sets the primary context's flags through the
    driver (libcuda), before the process creates its context: the first tensor on the device.
    Returns whether it set them.
    """
    if device.type != "cuda" or mode == "auto":
        return False
    if mode not in CUDA_WAITS:
        raise ValueError(f"CUDA host waits: one of auto, {', '.join(CUDA_WAITS)}; got {mode!r}")
    driver = ctypes.CDLL("libcuda.so.1")
    ordinal, handle = device.index or 0, ctypes.c_int()
    set_flags = getattr(driver, "cuDevicePrimaryCtxSetFlags_v2", None) or driver.cuDevicePrimaryCtxSetFlags
    for call, args in (
        (driver.cuInit, (0,)),
        (driver.cuDeviceGet, (ctypes.byref(handle), ordinal)),
        (set_flags, (handle, CUDA_WAITS[mode])),
    ):
        if (status := call(*args)) != 0:
            raise RuntimeError(f"CUDA driver call {call.__name__} failed with status {status}")
    log.info("CUDA host waits on device %d: %s", ordinal, mode)
    return True


def freeze_heap() -> int:
    """Collect once, then move every object alive out of the collector's reach (``gc.freeze``).
    Returns how many objects are frozen.

    A process with torch, timm and the server loaded holds ~430,000 objects, and a full collection
    walks every one of them with the GIL held: 250-450 ms on the 2-core build machine, every thread
    of the process stopped (the engine's decode, pass and collector threads too). Under load, the
    objects a request keeps for a few milliseconds outlive young collections, and once the promoted
    ones reach a quarter of the long-lived count, Python runs a full collection: in one server
    process at ~1,000 requests a second, one every ~20 s, 310-400 ms each (benchmarks/gc_pauses.py,
    benchmarks/RESULTS.md §3.17). What start-up made lives as long as the process, so it is frozen
    once, after loading; a full collection then walks only what came since (1-3 ms there). vLLM
    freezes its heap after warm-up for the same reason, as SGLang does. Garbage without cycles is
    still freed by its reference count; only cycles among frozen objects would outlive it (there are
    none after the collection just before). Only entry points call it, once ready to serve.
    """
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("heap frozen: %d objects out of the garbage collector's reach", frozen)
    return frozen
