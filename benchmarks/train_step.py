"""Cost of one adapter training step, against a fused inference pass and against dense back-prop.

    python -m benchmarks.train_step                  # ViT-B/32, batch 32, ~2 minutes on 2 CPU cores

In interleaved rounds, on the same batch:
- infer: one fused inference pass with the adapter loaded (torch.inference_mode);
- step:  ``memvit train``'s step (adapters/training/step.py): the base's pass without autograd
         (docs/design.md §2.3; a CUDA graph on a GPU), the class-token path written out forward and
         backward from its activations, loss, backward, the joint clip and SGD update;
- split: the step as it was before (kept to compare): the split path's forward recorded by
         autograd for the class-token rows, then clip_grad_norm_ and SGD.step;
- dense: the same step through the dense-mask model, where autograd records every row of every
         layer (how the public reproduction trains);
- step N: the trainer's step training N adapters at once (a sweep's variants: different learning
         rates and memory sizes), against the same step training one.
Ratios are medians of per-round ratios. Targets: step <= 1.5 x infer, dense >= 2 x step,
step N <= 1.3 x step 1 at N = 8 (N separate runs cost N x).
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from benchmarks.common import argument_parser, environment, interleaved, median_ratio, pin_malloc
from memvit.adapters.training import TrainableAdapter, TrainConfig
from memvit.adapters.training.step import TrainStep
from memvit.adapters.training.variant import Variant
from memvit.memory_core import AdapterWeights, MemoryViT
from memvit.memory_core.oracle.reference import DenseMemoryViT


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--arch", default="vit_base_patch32_224")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--memory", type=int, default=5)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--variants", type=int, default=8, help="adapters trained at once for 'step N'")
    args = parser.parse_args(argv)
    malloc = pin_malloc()
    torch.manual_seed(0)
    engine = MemoryViT.from_timm(args.arch)
    x = torch.randn(args.batch, 3, *engine.spec.img_size)
    y = torch.randint(0, args.classes, (args.batch,))

    adapter = TrainableAdapter(engine, "bench", num_classes=args.classes, memory_tokens=args.memory)
    with torch.no_grad():  # a non-zero head, so that every parameter gets a gradient from step one
        adapter.head.weight.normal_(0, 0.02)
    params = [p for p in adapter.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    served = engine.prepare_set([adapter.weights()])

    def infer() -> None:
        with torch.inference_mode():
            engine(x, served)

    def split_step() -> None:
        loss = F.cross_entropy(adapter(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()

    def dense_step() -> None:
        # The adapter's live parameters (adapter.weights() would detach them), so that autograd
        # reaches them through the dense model.
        weights = AdapterWeights(
            "bench", adapter.memory, adapter.cls_token, adapter.head.weight, adapter.head.bias
        )
        _, logits = DenseMemoryViT(engine.base, [weights])(x)
        loss = F.cross_entropy(logits["bench"], y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()

    classes = tuple(f"c{i}" for i in range(args.classes))

    def variants(n: int) -> list[Variant]:
        # A sweep's variants: learning rates and memory sizes differ, the data is shared.
        configs = [
            TrainConfig(
                name=f"v{i}",
                train_dir="-",
                lr=0.01 * (i + 1),
                memory_tokens=(1, args.memory)[i % 2],
                steps=1000,
            )
            for i in range(n)
        ]
        made = [Variant(engine, c, classes, None, total=1000, init_images=x[:4]) for c in configs]
        for v in made:
            with torch.no_grad():
                v.adapter.head.weight.normal_(0, 0.02)
        return made

    def trainer_step(chosen: list[Variant]):
        step = TrainStep(engine, chosen)

        def call() -> None:
            step(x, y)
            step.pending.clear()

        return call

    alone = TrainConfig(name="bench", train_dir="-", lr=0.01, memory_tokens=args.memory, steps=1000)
    single = [Variant(engine, alone, classes, None, total=1000, init_images=x[:4])]
    single[0].adapter.load_state_dict(adapter.state_dict())  # the same adapter (m = --memory) as split
    one, many = variants(1), variants(args.variants)
    engine.train()  # as a run does (the base stays in eval mode)
    fns = {
        "infer": infer,
        "step": trainer_step(single),
        "split": split_step,
        "dense": dense_step,
        "step 1": trainer_step(one),
        f"step {args.variants}": trainer_step(many),
    }
    times = interleaved(fns, args.rounds)
    print(
        environment(
            args.arch,
            f"batch {args.batch}",
            f"one adapter with m={args.memory}",
            f"{args.classes} classes",
            f"{args.rounds} rounds",
            malloc,
        )
    )
    print(
        "| infer ms | step ms | split step ms | dense step ms | step / infer | step / split | dense / step |"
    )
    print("|--:|--:|--:|--:|--:|--:|--:|")
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    step_infer, dense_step_ratio = median_ratio(times, "step", "infer"), median_ratio(times, "dense", "step")
    print(
        f"| {med['infer']:.0f} | {med['step']:.0f} | {med['split']:.0f} | {med['dense']:.0f} "
        f"| {step_infer:.3f} | {median_ratio(times, 'step', 'split'):.3f} | {dense_step_ratio:.2f} |"
    )
    n = args.variants
    multi = median_ratio(times, f"step {n}", "step 1")
    print(
        f"\n| trainer step, 1 adapter (ms) | {n} adapters at once (ms) | {n} at once / 1 "
        f"| {n} separate runs / 1 |\n|--:|--:|--:|--:|"
    )
    ms_one, ms_many = (1e3 * statistics.median(times[k]) for k in ("step 1", f"step {n}"))
    print(f"| {ms_one:.0f} | {ms_many:.0f} | {multi:.3f} | {n} |")
    print(
        f"targets: step <= 1.5 x infer: {'ok' if step_infer <= 1.5 else 'MISS'}; "
        f"dense >= 2 x step: {'ok' if dense_step_ratio >= 2 else 'MISS'}; "
        f"{n} adapters <= 1.3 x one: {'ok' if multi <= 1.3 else 'MISS'}"
    )


if __name__ == "__main__":
    main()
