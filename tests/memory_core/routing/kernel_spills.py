"""Compile Triton kernels for sm_90 and say what ptxas spilled: ``python -m
tests.memory_core.routing.kernel_spills`` reads a JSON list of ``[kernel, constants, dtype, warps]``
on stdin and writes a JSON list of ``[bytes spilled per thread, registers]``.

Neither step needs a GPU: Triton's compiler targets sm_90 by name and ptxas ships with Triton. A
process of its own, without ``TRITON_INTERPRET`` (the tests' interpreter replaces the kernels, and
patches Triton's language, in the process that runs them).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

INDEX = ("mlen_ptr", "slot_ptr", "lin_ptr", "rows_ptr", "slots_ptr")  # int64 tensors; other *_ptr: data


def ptxas() -> Path | None:
    import triton.backends.nvidia as nvidia

    path = Path(nvidia.__file__).parent / "bin" / "ptxas"
    return path if path.exists() else None


def spilled(kernel: str, constants: dict, dtype: str, warps: int, assembler: Path) -> tuple[int, int]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from memvit.memory_core.routing import triton_kernels

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


def main() -> None:
    assembler = ptxas()
    if assembler is None:
        print(json.dumps(None))
        return
    jobs = json.load(sys.stdin)
    print(
        json.dumps(
            [spilled(kernel, constants, dtype, warps, assembler) for kernel, constants, dtype, warps in jobs]
        )
    )


if __name__ == "__main__":
    main()
