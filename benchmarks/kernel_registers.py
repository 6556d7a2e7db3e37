"""What the Triton kernels' tiles spill on an H100/H200, compiled here: no GPU needed.

    python -m benchmarks.kernel_registers                       # the table, this Triton, ~2 min
    python -m benchmarks.kernel_registers --triton-python PY    # compiled by PY's Triton instead
    python -m benchmarks.kernel_registers --jobs                # JSON jobs on stdin (the tests')

Each tile the launchers choose (memory_core/routing/kernel_tiles.py) is compiled for sm_90 by Triton's
own compiler and its PTX assembled by the ptxas Triton ships (``ptxas -v``): the bytes each thread
spills to local memory and the registers it uses, as on the GPU. A spilled value is stored to local
memory (the L1, and past it HBM) and loaded back at every step of the loop that needs it.

The compiling side (``--jobs``) needs Triton alone: it reads the kernels' source out of
triton_kernels.py, so another environment's Triton (the GPU host's version, say: ``--triton-python
/tmp/t36/bin/python`` after ``python -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0``)
compiles the same kernels. It runs as a process of its own, without ``TRITON_INTERPRET`` (the tests'
interpreter replaces the kernels, and patches Triton's language, in the process that runs them).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "memory_core" / "routing" / "triton_kernels.py"
INDEX = ("mlen_ptr", "slot_ptr", "lin_ptr", "rows_ptr", "slots_ptr")  # int64 tensors; other *_ptr: data
ATTENTION = "_class_token_attention_jit"
Job = tuple[str, dict, str, int]  # kernel, constexprs, data type, warps


def _type(dtype: Any) -> str:
    return {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}[str(dtype)]


def attention_job(R: int, d: int, dtype: Any, **kwargs: Any) -> Job:
    from memvit.memory_core.routing.kernel_tiles import attention_tiles

    tile = attention_tiles(R, d, dtype, **kwargs)
    constants = dict(A=1, BLOCK_R=tile.rows, BLOCK_T=tile.keys, BLOCK_P=tile.memory, BLOCK_D=tile.features)
    return (ATTENTION, constants, _type(dtype), tile.warps)


def head_jobs(C: int, D: int, dtype: Any, tiles: str | None = None) -> list[Job]:
    """The gathered heads' (routed passes) and the shared heads' (the all-tasks pass, 256 images)."""
    from memvit.memory_core.routing.kernel_tiles import gathered_head_tiles, shared_head_tiles

    classes, features = gathered_head_tiles(C, D, tiles)
    images, shared_classes, shared_features = shared_head_tiles(256, C, D, dtype, tiles)
    shared = dict(BLOCK_B=images, BLOCK_C=shared_classes, BLOCK_D=shared_features)
    return [
        ("_gathered_heads_kernel", dict(BLOCK_C=classes, BLOCK_D=features), _type(dtype), 4),
        ("_shared_heads_kernel", shared, _type(dtype), 4),
    ]


def compile_jobs(jobs: list[Job], python: str | None = None) -> dict:
    """``{"triton": version, "results": [(bytes spilled per thread, registers), ...] or None}`` (None:
    that Triton ships no ptxas), compiled by ``python`` (default: this interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [python or sys.executable, "-m", "benchmarks.kernel_registers", "--jobs"],
        input=json.dumps(jobs), capture_output=True, text=True, env=env, cwd=ROOT, timeout=900,
    )  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"compiling the kernels failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


# -- the compiling side: Triton alone ----------------------------------------------------------------
def _kernels(tmp: Path) -> Any:
    """triton_kernels.py's ``@triton.jit`` functions as a module of their own (Triton reads a kernel's
    source from its file, so they are written to one)."""
    text = KERNELS.read_text()
    lines = text.splitlines()
    parts = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef) and any(
            ast.unparse(d) == "triton.jit" for d in node.decorator_list
        ):
            first = min(d.lineno for d in node.decorator_list)
            parts.append(textwrap.dedent("\n".join(lines[first - 1 : node.end_lineno])))
    path = tmp / "memvit_triton_kernels.py"
    path.write_text("import triton\nimport triton.language as tl\n\n\n" + "\n\n\n".join(parts) + "\n")
    spec = importlib.util.spec_from_file_location("memvit_triton_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _spilled(kernels: Any, job: Job, assembler: Path, tmp: Path) -> tuple[int, int]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel, constants, dtype, warps = job
    fn = getattr(kernels, kernel)
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
    source = tmp / "kernel.ptx"
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


def _compile_stdin() -> None:
    import triton
    import triton.backends.nvidia as nvidia

    assembler = Path(nvidia.__file__).parent / "bin" / "ptxas"
    jobs = json.load(sys.stdin)
    results = None
    if assembler.exists():
        with tempfile.TemporaryDirectory() as tmp:
            kernels = _kernels(Path(tmp))
            results = [_spilled(kernels, tuple(job), assembler, Path(tmp)) for job in jobs]
    print(json.dumps({"triton": triton.__version__, "results": results}))


# -- the table ---------------------------------------------------------------------------------------
def table(python: str | None) -> None:
    import torch

    rows: list[tuple[str, str, str, Job, Job]] = []  # kernel, shape, dtype, before, now
    shapes = [("all tasks", 1000, 64, None), ("routed", 8, 64, None), ("all tasks", 1000, 128, None),
              ("one row", 1000, 64, 1)]  # fmt: skip
    for dtype in (torch.bfloat16, torch.float32):
        for label, R, d, one in shapes:
            before, now = (attention_job(R, d, dtype, block_rows=one, tiles=t) for t in ("wide", None))
            rows.append(("class-token attention", f"{label}, {d} features", _type(dtype), before, now))
        for C, D in [(100, 768), (1000, 192)]:
            for before, now in zip(head_jobs(C, D, dtype, "wide"), head_jobs(C, D, dtype), strict=True):
                name = "gathered heads" if "gathered" in now[0] else "shared heads"
                rows.append((name, f"{C} classes, {D} features", _type(dtype), before, now))
    done = compile_jobs([job for row in rows for job in row[3:]], python)
    if done["results"] is None:
        sys.exit("that Triton ships no ptxas")
    results = iter(done["results"])
    print(f"Triton {done['triton']}'s compiler for sm_90 and its ptxas ({python or sys.executable})\n")
    print("| kernel | shape | dtype | before: spilled B/thread, registers | now: spilled, registers |")
    print("|---|---|---|--:|--:|")
    for name, shape, dtype, _, _ in rows:
        (a, ra), (b, rb) = next(results), next(results)
        print(f"| {name} | {shape} | {dtype} | {a}, {ra} | {b}, {rb} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", action="store_true", help="JSON [kernel, constants, dtype, warps] on stdin")
    parser.add_argument("--triton-python", help="the Python whose Triton compiles (default: this one)")
    args = parser.parse_args(argv)
    if args.jobs:
        _compile_stdin()
    else:
        table(args.triton_python)


if __name__ == "__main__":
    main()
