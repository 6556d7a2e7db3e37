"""What a training step runs outside its CUDA graph: per step, from ``torch.profiler``.

The step's graph holds everything its function does (adapters/training/step_graph.py), which runs
inside a ``record_function(GRAPH_MARK)``: eagerly (the CPU, a warm-up) its ops are profiled inside
that mark; replayed on a GPU the function does not run at all (one ``cudaGraphLaunch``), so the
mark does not appear. Either way the leaf aten ops inside a step's own mark but outside the graph's
are what the host launches one by one around the graph: on a GPU with a small base, the step's cost
beyond its kernels. On the CPU a ``TrainStep`` with ``rehearse=True`` takes the graph's route (static
inputs copied in, the function on them, its output cloned), so the count there is the GPU's.

    counts = step_ops(lambda: step(x, y), steps=3, cuda=False)
    counts["outside the graph"]   # leaf aten ops per step the graph does not hold
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from memvit.adapters.training.step_graph import GRAPH_MARK

from .trace import summarize

STEP_MARK = "benchmark: one training step"


def step_ops(call: Callable[[], object], steps: int = 3, *, cuda: bool) -> dict[str, float | None]:
    """Per step of ``steps`` calls: leaf aten ops in all, inside the graph's function (run eagerly),
    outside it, host syncs (on CPU: the aten ops that would wait for a GPU) and, on CUDA, the host's
    launch calls and graph launches."""
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as recorded:
        for _ in range(steps):
            with record_function(STEP_MARK):
                call()
        if cuda:
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory(prefix="memvit-step-ops-") as tmp:
        path = Path(tmp) / "trace.json"
        recorded.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    total = summarize(events, steps, mark=STEP_MARK, gpu=cuda)
    inside = summarize(events, steps, mark=GRAPH_MARK, gpu=cuda)
    return {
        "aten ops": total["aten ops"],
        "in the graph": inside["aten ops"],
        "outside the graph": total["aten ops"] - inside["aten ops"],
        "host syncs": total["host syncs"],
        "launch calls": total["launch calls"],
        "graph launches": total["graph launches"],
    }
