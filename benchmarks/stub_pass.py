"""The model's device work stubbed out, for benchmarks that measure everything around it.

``stubbed_device_pass`` stands in for the engine's ``_device_pass`` (memory_core/engine/
slot_passes.py), the part of a pass that runs the network: it returns zeros in the shapes that part
returns (the base's logits (B, C_0), and the plan's output rows of adapter logits, flat). Everything
else a pass does on the host runs as it does for real: the plan (routing/planner.py), the output
index, the lazy ``FusedOutput`` the server cuts its answers from. So a server or a model process does
all of its work but the network's (tests/benchmarks/test_stub_pass.py holds the stub's output to the
real pass's form).

(Until 2026-11-27 the stub replaced ``MemoryViT.forward`` and built its output per task, the dense
form; a real pass returns the flat form, so the server then padded and joined every task's zeros per
batch, work a real pass never causes, and skipped the plan, which a real pass always makes: RESULTS
§3.14 has both stubs' figures.)

``install`` patches it in; ``site_dir`` writes a ``sitecustomize`` that installs it in every Python
process started with that directory on its ``PYTHONPATH`` (a server and the processes it spawns).
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def stubbed_device_pass(self, x, tensors, plan, path):
    """The base's logits and the plan's adapter logits, zeros, in the engine's shapes and dtype: the
    output rows of a routed plan (N, C), every row of a shared one (R * B, C)."""
    import torch

    base = torch.zeros(x.shape[0], self.base.num_classes, dtype=self.dtype)
    if plan is None:
        return base, None
    shape = plan.shape
    rows = shape.rows * shape.images if shape.shared else shape.outputs
    return base, torch.zeros(rows, shape.classes, dtype=self.dtype)


def install() -> None:
    from memvit.memory_core import MemoryViT

    MemoryViT._device_pass = stubbed_device_pass


def site_dir(root: Path) -> Path:
    """A directory whose ``sitecustomize`` stubs the pass in the process that starts with it on its
    path (after whatever ``memvit`` comes first there)."""
    where = root / "stub-pass"
    where.mkdir(exist_ok=True)
    (where / "sitecustomize.py").write_text(
        f"import sys\nsys.path.append({str(REPO)!r})\nfrom benchmarks.stub_pass import install\ninstall()\n"
    )
    return where
