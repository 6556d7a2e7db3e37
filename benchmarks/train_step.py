"""Cost of one adapter training step, against a fused inference pass and against dense back-prop.

    python benchmarks/train_step.py                  # ViT-B/32, batch 32, ~2 minutes on 2 CPU cores

In interleaved rounds, on the same batch:
- infer: one fused inference pass with the adapter loaded (torch.inference_mode);
- step:  memvit's training step: fused forward (base rows without autograd, DESIGN 2.3), loss,
         backward, gradient clipping, SGD update;
- dense: the same step through the dense-mask model, where autograd records every row of every
         layer (how the public reproduction trains).
Ratios are medians of per-round ratios. Targets (issue #3): step <= 1.5 x infer, dense >= 2 x step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("KINETO_LOG_LEVEL", "5")

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapters.training import TrainableAdapter
from memory_core import AdapterWeights, DenseMemoryViT, MemoryViT
from memory_core.runtime import tune_malloc


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="vit_base_patch32_224")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--memory", type=int, default=5)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)
    tune_malloc()
    torch.manual_seed(0)
    engine = MemoryViT.from_timm(args.arch)
    x = torch.randn(args.batch, 3, *engine.spec.img_size)
    y = torch.randint(0, args.classes, (args.batch,))

    adapter = TrainableAdapter(engine, "bench", num_classes=args.classes, memory_tokens=args.memory)
    with torch.no_grad():  # a non-zero head, so that every parameter gets a gradient from step one
        adapter.head.weight.normal_(0, 0.02)
    params = [p for p in adapter.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    engine.add_adapter(adapter.weights())

    def infer() -> None:
        with torch.inference_mode():
            engine(x)

    def step() -> None:
        loss = F.cross_entropy(adapter(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()

    def dense_step() -> None:
        weights = AdapterWeights(
            "bench", adapter.memory, adapter.cls_token, adapter.head.weight, adapter.head.bias
        )
        _, logits = DenseMemoryViT(engine.base, [weights])(x)
        loss = F.cross_entropy(logits["bench"], y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()

    fns = {"infer": infer, "step": step, "dense": dense_step}
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(args.rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)

    def ratio(a: str, b: str) -> float:
        return statistics.median(ta / tb for ta, tb in zip(times[a], times[b], strict=True))

    print(
        f"{args.arch}, batch {args.batch}, one adapter with m={args.memory}, {args.classes} classes, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} rounds"
    )
    print("| infer ms | step ms | dense step ms | step / infer | dense step / step |")
    print("|--:|--:|--:|--:|--:|")
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    step_infer, dense_step_ratio = ratio("step", "infer"), ratio("dense", "step")
    print(
        f"| {med['infer']:.0f} | {med['step']:.0f} | {med['dense']:.0f} "
        f"| {step_infer:.3f} | {dense_step_ratio:.2f} |"
    )
    print(
        f"targets: step <= 1.5 x infer: {'ok' if step_infer <= 1.5 else 'MISS'}; "
        f"dense >= 2 x step: {'ok' if dense_step_ratio >= 2 else 'MISS'}"
    )


if __name__ == "__main__":
    main()
