"""The Triton kernels' tiles (memory_core/routing/triton_kernels.py): the rows, keys, memory
positions, classes and features one program holds, and its warps, chosen so that every value a
program keeps lives in registers on an H100 or H200 (sm_90).

A tile too large for the registers does not fail: ptxas spills the rest to local memory (the L1 and,
past it, HBM) and reads it back at every step of the loop that needs it. Compiled for sm_90 by
Triton's compiler and ptxas, which run without a GPU, the tiles used before this file spilled in
every pass but the batch-invariant mode's: the class-token attention's 64-row tile in bfloat16 2,712
bytes per thread with Triton 3.6.0 (13,214 with 3.8.0), its 16-row tile (routed passes) 304 (3,040),
float32's 1,292 (544); the gathered heads' (128, 128) tile 1,124 with 3.8. The memory part was the
cause: each (rows, memory chunk, features) product was held in float32, (64, 8, 64) values over 128
threads, 256 registers per thread for the memory keys alone. Now a program reads its rows' memory
one position per step, a (rows, features) tile as the lineage's class tokens are read; tiles of 16
rows or more run on 8 warps; 128-feature heads and float32 take 16 rows (float32 32 keys at a time);
the gathered heads' weight tiles 64 by 64. Nothing spills with Triton 3.6.0 (the GPU host's) nor
3.8.0 (this project's CPU builds), whose register allocations differ:
tests/memory_core/routing/test_kernel_registers.py compiles every choice made here for sm_90 with
the installed Triton and holds it to zero bytes spilled; ``python -m benchmarks.kernel_registers
--triton-python`` another environment's interpreter compiles them with its Triton.

``TILES``: "registers" (these), "wide" (the tiles before), "narrow" (these with 16 rows at most:
113-192 registers a thread, so up to two programs of 8 warps share an SM where one 64-row program
has it, for reading the image's keys four times as often) or "deep" (64-row tiles on 16 warps: 128
registers a thread, 16 warps an SM against 8), for the GPU suite's try that times them against each
other (benchmarks/gpu/tries.py ``tiles``). A CUDA graph replays the kernels it was
captured with, so the try runs its passes eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TILES = "registers"


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class AttentionTiles:
    """One program of the class-token attention: ``rows`` class-token rows of one image and head,
    the image's keys ``keys`` at a time, its rows' memory ``memory`` positions at a time."""

    rows: int
    keys: int
    memory: int
    features: int
    warps: int


def attention_tiles(
    R: int, d: int, dtype: torch.dtype, block_rows: int | None = None, tiles: str | None = None
) -> AttentionTiles:
    """For R rows per image of head width d. ``block_rows``: the rows per program asked for (1: each
    row its own program, the batch-invariant mode), else by R: the more rows a program holds, the
    fewer times the image's keys are read, up to what the registers hold."""
    features = max(next_power_of_2(d), 16)
    tiles = tiles or TILES
    if tiles == "wide":  # before: float32 16 rows, half types 64, memory in chunks, 4 warps
        rows = block_rows or min(max(next_power_of_2(R), 16), 16 if dtype == torch.float32 else 64)
        return AttentionTiles(rows, 64 if rows >= 16 else 32, 8 if features <= 64 else 4, features, 4)
    # float32 scores exactly (input_precision="ieee": no tensor cores), so its products stay on the
    # CUDA cores' registers: 16 rows, 32 keys at a time (a 64-row tile ran the all-tasks pass 2.1x
    # slower than torch's kernels on an H200, 16-row tiles 1.09x faster).
    exact = dtype == torch.float32
    widest = 16 if exact or tiles == "narrow" or features > 64 else 64
    rows = block_rows or min(max(next_power_of_2(R), 16), widest)
    if rows >= 16:  # the base keys on the tensor cores (tl.dot needs 16 rows)
        warps = 16 if tiles == "deep" and rows == 64 else 8
        return AttentionTiles(rows, 32 if exact else 64, 1, features, warps)
    # One row: no tensor cores, (keys, features) products; memory in chunks of 8 (4 for 128 features).
    return AttentionTiles(rows, 32, 8 if features <= 64 else 4, features, 4)


def gathered_head_tiles(C: int, D: int, tiles: str | None = None) -> tuple[int, int]:
    """(classes, features) of one output row's head per program: its weight tile in float32."""
    wide = (tiles or TILES) == "wide"
    classes = min(max(next_power_of_2(C), 16), 128 if wide else 64)  # rows of 64 features: 128 bytes
    return classes, min(max(next_power_of_2(D), 16), 128 if wide else min(128, 4096 // classes))


def shared_head_tiles(
    B: int, C: int, D: int, dtype: torch.dtype, tiles: str | None = None
) -> tuple[int, int, int]:
    """(images, classes, features) of one row's head applied to a tile of images."""
    images = min(max(next_power_of_2(B), 16), 64)
    classes = min(max(next_power_of_2(C), 16), 64)
    widest = 32 if dtype == torch.float32 and (tiles or TILES) != "wide" else 64  # float32: FMAs
    return images, classes, min(max(next_power_of_2(D), 16), widest)
