"""The GPU suite: everything a lent GPU machine should measure, runnable in ~9-minute commands.

``python -m benchmarks.gpu --help``; how to run it on a lent machine and what to carry: docs/gpu.md.
Its CPU form (``--cpu-smoke``) runs in CI (tests/benchmarks/test_gpu_suite.py).
"""

import os

os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # keeps the CPU memory profiler quiet
try:
    import torch
except ImportError:  # the import check (benchmarks.gpu.imports) says so
    torch = None
if torch is not None and not torch.cuda.is_available():
    # Without a GPU the Triton kernels run through Triton's interpreter (the engine step's kernel
    # try on CPU), which it selects only when this is set before Triton is first imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")
