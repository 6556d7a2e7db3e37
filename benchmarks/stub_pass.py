"""The model's pass stubbed out, for benchmarks that measure everything around it.

``stubbed_forward`` stands in for ``MemoryViT.forward``: it returns zeros in the pass's shapes (the
base's classes, and each asked adapter's, for every image or for each image's own tasks), so a
server or a model process does all of its work but the model's. ``install`` patches it in;
``site_dir`` writes a ``sitecustomize`` that installs it in every Python process started with that
directory on its ``PYTHONPATH`` (a server and the processes it spawns).
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def stubbed_forward(self, x, adapter_set=None, *, tasks=None, path="auto"):
    """The pass's outputs, zeros, in their shapes: every adapter for every image (``tasks`` None), or
    each image's own (a ``TaskIndex``, or names per image)."""
    import numpy as np
    import torch

    from memvit.memory_core import AdapterSet, FusedOutput, TaskIndex

    adapter_set = adapter_set if adapter_set is not None else AdapterSet()
    B = x.shape[0]
    base = torch.zeros(B, self.base.num_classes)
    if tasks is None:
        adapters = {a.name: torch.zeros(B, a.head_weight.shape[0]) for a in adapter_set}
        return FusedOutput.every_image(base, adapters, adapter_set)
    if not isinstance(tasks, TaskIndex):
        tasks = TaskIndex.from_names(adapter_set, tasks)
    image = np.repeat(np.arange(B), tasks.counts)
    adapters, images = {}, {}
    for position in np.unique(tasks.tasks).tolist():
        adapter = adapter_set.adapters[position]
        who = torch.from_numpy(image[tasks.tasks == position])
        adapters[adapter.name] = torch.zeros(len(who), adapter.head_weight.shape[0])
        images[adapter.name] = who
    return FusedOutput.of_tasks(base, adapters, images, adapter_set)


def install() -> None:
    from memvit.memory_core import MemoryViT

    MemoryViT.forward = stubbed_forward


def site_dir(root: Path) -> Path:
    """A directory whose ``sitecustomize`` stubs the pass in the process that starts with it on its
    path (after whatever ``memvit`` comes first there)."""
    where = root / "stub-pass"
    where.mkdir(exist_ok=True)
    (where / "sitecustomize.py").write_text(
        f"import sys\nsys.path.append({str(REPO)!r})\nfrom benchmarks.stub_pass import install\ninstall()\n"
    )
    return where
