"""Step ``training``: one adapter training step on the device, for 1 and for 8 fused variants.

The trainer's own step (``adapters/training/variant.py``, ``fused_step``: one fused pass, the base
rows without autograd, a summed loss, each variant's own optimiser), as ``benchmarks/train_step.py``
measures it on CPU, against one fused inference pass on the same batch. Goals (the CPU ones):
step <= 1.5 x an inference pass; 8 variants at once <= 1.3 x one. The variants' parameters are moved
to the device here: the trainer itself runs on CPU.
"""

from __future__ import annotations

import torch

from memvit.adapters.training import TrainConfig
from memvit.adapters.training.variant import Variant, fused_step

from .plan import Plan, engine, images, rate, ratio, timed_rounds
from .report import Budget, StepReport, goal

CLASSES = 10


def run(plan: Plan, report: StepReport, budget: Budget) -> str:
    for arch in plan.archs:
        for batch in plan.train_batches:
            if not report.room(budget, 30):
                report.note(f"budget spent: stopped before {arch} batch {batch}")
                return "partial"
            what = {"arch": arch, "dtype": "fp32", "batch": batch}
            report.attempt("training step", what, _step, arch, batch, plan)
    return "done"


def _variants(e, x: torch.Tensor, n: int) -> list[Variant]:
    classes = tuple(f"c{i}" for i in range(CLASSES))
    made = []
    for i in range(n):  # a sweep's variants: learning rates and memory sizes differ, the data is shared
        config = TrainConfig(
            name=f"v{i}", train_dir="-", lr=0.01 * (i + 1), memory_tokens=(1, 5)[i % 2], steps=1000
        )
        v = Variant(e, config, classes, None, total=1000, init_images=x[:4])
        v.adapter.to(e.device)  # in place: the optimiser keeps the same parameters
        with torch.no_grad():
            v.adapter.head.weight.normal_(0, 0.02)  # every parameter gets a gradient from the first step
        made.append(v)
    return made


def _step(arch: str, batch: int, plan: Plan) -> dict:
    e = engine(arch, plan)
    x = images(e, batch)
    y = torch.randint(0, CLASSES, (batch,), device=e.device)
    one, many = _variants(e, x, 1), _variants(e, x, plan.variants)
    served = e.prepare_set([one[0].adapter.weights()])

    def infer() -> None:
        with torch.inference_mode():
            e(x, served)

    times = timed_rounds(
        {
            "infer": infer,
            "step 1": lambda: fused_step(e, one, None, x, y),
            f"step {plan.variants}": lambda: fused_step(e, many, None, x, y),
        },
        plan.device,
        plan.rounds,
    )
    per_infer = ratio(times, "step 1", "infer")
    many_over_one = ratio(times, f"step {plan.variants}", "step 1")
    return {
        "infer_img_s": rate(times["infer"], batch),
        "step 1: img/s": rate(times["step 1"], batch),
        f"step {plan.variants}: img/s": rate(times[f"step {plan.variants}"], batch),
        "step 1 / infer": per_infer,
        "goal <= 1.5": goal(per_infer, "<=", 1.5),
        f"step {plan.variants} / step 1": many_over_one,
        "goal <= 1.3": goal(many_over_one, "<=", 1.3),
    }
