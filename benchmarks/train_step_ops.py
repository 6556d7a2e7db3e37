"""Operations per training step, and how many of them run outside the step's CUDA graph, on the CPU.

    python -m benchmarks.train_step_ops            # DeiT-Tiny shape (random init), batch 8, 1 and 8 adapters

What bounds a small base's step on a GPU is the host launching operations one by one. A CPU has no
graphs, but the trainer's step can take the graph's route there (``TrainStep(rehearse=True)``:
static inputs copied in, the graph's function run on them, its output cloned), so the profiler sees
per step what a GPU would launch in all, what its graph would hold and what it would run outside it
(benchmarks/gpu/step_ops.py), plus the ops that would wait for the device. One thread, a few steps
after the warm-up; the figures are counts, not times, so a busy machine does not change them.
"""

from __future__ import annotations

import torch

from benchmarks.common import argument_parser, environment
from benchmarks.gpu.step_ops import step_ops
from memvit.adapters.training import TrainConfig
from memvit.adapters.training.step import TrainStep
from memvit.adapters.training.step_graph import WARM_UP
from memvit.adapters.training.variant import Variant
from memvit.memory_core import MemoryViT


def variants(engine: MemoryViT, x: torch.Tensor, n: int, classes: int) -> list[Variant]:
    """A sweep's variants: learning rates and memory sizes differ (benchmarks/gpu/training.py's)."""
    labels = tuple(f"c{i}" for i in range(classes))
    made = []
    for i in range(n):
        config = TrainConfig(name=f"v{i}", train_dir="-", lr=0.01 * (i + 1), memory_tokens=(1, 5)[i % 2])
        v = Variant(engine, config, labels, None, total=1000, init_images=x[:4])
        with torch.no_grad():
            v.adapter.head.weight.normal_(0, 0.02)  # every parameter gets a gradient from the first step
        made.append(v)
    return made


def counts(engine: MemoryViT, batch: int, n: int, classes: int = 10, steps: int = 3) -> dict:
    """``step_ops`` of the trainer's step for ``n`` variants on one batch, past its warm-up."""
    x = torch.randn(batch, 3, *engine.spec.img_size, generator=torch.Generator().manual_seed(0))
    y = torch.arange(batch) % classes
    engine.train()
    step = TrainStep(engine, variants(engine, x, n, classes), rehearse=engine.device.type == "cpu")
    for _ in range(WARM_UP + 1):
        step(x, y)
    found = step_ops(lambda: step(x, y), steps, cuda=engine.device.type == "cuda")
    step.flush()
    return {**found, "graphed or rehearsed": step.path.static}


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--arch", default="deit_tiny_patch16_224")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--variants", default="1,8", help="comma-separated numbers of adapters")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    engine = MemoryViT.from_timm(args.arch)
    print(environment(f"{args.arch} (random init), batch {args.batch}, 1 thread"))
    print("| adapters | aten ops / step | in the graph | outside the graph | host syncs |")
    print("|--:|--:|--:|--:|--:|")
    for n in (int(v) for v in args.variants.split(",")):
        c = counts(engine, args.batch, n)
        assert c["graphed or rehearsed"], "the step did not take the graph's route"
        row = (c["aten ops"], c["in the graph"], c["outside the graph"], c["host syncs"])
        print(f"| {n} | " + " | ".join(f"{v:,.0f}" for v in row) + " |")


if __name__ == "__main__":
    main()
