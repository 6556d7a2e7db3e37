"""What the Triton kernels' tiles spill on an H100/H200, compiled here: no GPU needed.

    python -m benchmarks.kernel_registers            # the table: tiles before ("wide") and now, ~2 min
    python -m benchmarks.kernel_registers --jobs     # JSON jobs on stdin -> JSON results (the tests')

Each tile the launchers choose (memory_core/routing/kernel_tiles.py) is compiled for sm_90 by Triton's
own compiler and its PTX assembled by the ptxas Triton ships (``ptxas -v``): the bytes each thread
spills to local memory and the registers it uses, as on the GPU. A spilled value is stored to local
memory (the L1, and past it HBM) and loaded back at every step of the loop that needs it.

A process of its own, without ``TRITON_INTERPRET``: the tests' interpreter replaces the kernels, and
patches Triton's language, in the process that runs them (tests/memory_core/routing/
test_kernel_registers.py starts this module).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from memvit.memory_core.routing.kernel_tiles import attention_tiles, gathered_head_tiles, shared_head_tiles

INDEX = ("mlen_ptr", "slot_ptr", "lin_ptr", "rows_ptr", "slots_ptr")  # int64 tensors; other *_ptr: data
TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
ATTENTION = "_class_token_attention_jit"
Job = tuple[str, dict, str, int]  # kernel, constexprs, data type, warps


def attention_job(R: int, d: int, dtype: torch.dtype, **kwargs) -> Job:
    tile = attention_tiles(R, d, dtype, **kwargs)
    constants = dict(A=1, BLOCK_R=tile.rows, BLOCK_T=tile.keys, BLOCK_P=tile.memory, BLOCK_D=tile.features)
    return (ATTENTION, constants, TYPES[dtype], tile.warps)


def head_jobs(C: int, D: int, dtype: torch.dtype, tiles: str | None = None) -> list[Job]:
    """The gathered heads' (routed passes) and the shared heads' (the all-tasks pass, 256 images)."""
    classes, features = gathered_head_tiles(C, D, tiles)
    images, shared_classes, shared_features = shared_head_tiles(256, C, D, dtype, tiles)
    shared = dict(BLOCK_B=images, BLOCK_C=shared_classes, BLOCK_D=shared_features)
    return [
        ("_gathered_heads_kernel", dict(BLOCK_C=classes, BLOCK_D=features), TYPES[dtype], 4),
        ("_shared_heads_kernel", shared, TYPES[dtype], 4),
    ]


def ptxas() -> Path | None:
    import triton.backends.nvidia as nvidia

    path = Path(nvidia.__file__).parent / "bin" / "ptxas"
    return path if path.exists() else None


def spilled(job: Job, assembler: Path) -> tuple[int, int]:
    """(bytes spilled per thread, registers) of ``job`` compiled for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from memvit.memory_core.routing import triton_kernels

    kernel, constants, dtype, warps = job
    fn = getattr(triton_kernels, kernel)
    signature = {}
    for name in fn.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in INDEX:
            signature[name] = "*i64"
        elif name.endswith("_ptr"):
            signature[name] = f"*{dtype}"
        else:
            signature[name] = "fp32" if name == "scale" else "i32"
    constexprs = {(fn.arg_names.index(k),): v for k, v in constants.items()}
    compiled = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": warps},
    )
    ptx = compiled.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        arch = re.search(r"\.target (\S+)", ptx).group(1)
        out = subprocess.run(
            [str(assembler), f"-arch={arch}", "-v", str(source), "-o", os.devnull],
            capture_output=True, text=True, check=True,
        ).stderr  # fmt: skip
    stores = re.search(r"(\d+) bytes spill stores", out)
    registers = re.search(r"Used (\d+) registers", out)
    if not (stores and registers):
        raise RuntimeError(f"ptxas said nothing of registers: {out}")
    return int(stores.group(1)), int(registers.group(1))


def table(assembler: Path) -> None:
    print(f"torch {torch.__version__}, Triton's compiler for sm_90, {assembler}\n")
    print("| kernel | shape | dtype | before: spilled B/thread, registers | now: spilled, registers |")
    print("|---|---|---|--:|--:|")

    def row(name: str, shape: str, dtype: torch.dtype, before: Job, now: Job) -> None:
        (a, ra), (b, rb) = spilled(before, assembler), spilled(now, assembler)
        print(f"| {name} | {shape} | {TYPES[dtype]} | {a}, {ra} | {b}, {rb} |", flush=True)

    shapes = [("all tasks", 1000, 64, None), ("routed", 8, 64, None), ("all tasks", 1000, 128, None),
              ("one row", 1000, 64, 1)]  # fmt: skip
    for dtype in (torch.bfloat16, torch.float32):
        for label, R, d, rows in shapes:
            before, now = (attention_job(R, d, dtype, block_rows=rows, tiles=t) for t in ("wide", None))
            row("class-token attention", f"{label}, {d} features", dtype, before, now)
        for C, D in [(100, 768), (1000, 192)]:
            for before, now in zip(head_jobs(C, D, dtype, "wide"), head_jobs(C, D, dtype), strict=True):
                name = "gathered heads" if "gathered" in now[0] else "shared heads"
                row(name, f"{C} classes, {D} features", dtype, before, now)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", action="store_true", help="JSON [kernel, constants, dtype, warps] on stdin")
    args = parser.parse_args(argv)
    assembler = ptxas()
    if args.jobs:
        jobs = json.load(sys.stdin)
        print(json.dumps(None if assembler is None else [spilled(tuple(job), assembler) for job in jobs]))
    elif assembler is None:
        sys.exit("this Triton ships no ptxas")
    else:
        table(assembler)


if __name__ == "__main__":
    main()
