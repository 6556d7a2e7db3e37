"""The GPU suite: everything a lent GPU machine should measure, runnable in ~9-minute commands.

``python -m benchmarks.gpu --help``; how to run it on a lent machine and what to carry: docs/gpu.md.
Its CPU form (``--cpu-smoke``) runs in CI (tests/benchmarks/test_gpu_suite.py).
"""

import os

os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # keeps the CPU memory profiler quiet
