"""What a bfloat16 training step computes beyond a bfloat16 inference pass, counted on the CPU.

    python -m benchmarks.train_step_casts                          # DeiT-Tiny shape, batch 8
    python -m benchmarks.train_step_casts --arch vit_base_patch16_224 --batch 2

The GPU suite found the trainer's bfloat16 step at 2.9 inference passes (DeiT-Tiny, batch 64, an
H200) where float32's was 1.4, with the step one CUDA graph: so the excess is device work. Per call,
from ``torch.profiler`` (one thread, after warm-up; counts, not times, so a busy machine does not
change them): the operations that would launch kernels (leaf aten ops less the views and other
metadata-only ones), the dtype casts among them (``aten::_to_copy``) and the elements and bytes they
convert, and the bytes all of those operations read (their inputs: a proxy for the traffic a
memory-bound kernel pays). Calls: the served inference pass of a bfloat16 engine (one adapter), and
the trainer's step for one adapter in float32 and in bfloat16 (``TrainStep``, the graph's route
rehearsed: what a GPU's graph would hold). adapters/training/mixed_pass.py says what the bfloat16
step was and is.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import argument_parser, environment
from benchmarks.train_step_ops import variants
from memvit.adapters.training.step import TrainStep
from memvit.adapters.training.step_graph import WARM_UP
from memvit.memory_core import MemoryViT

# Leaf ops that launch no kernel on a GPU: views, metadata, allocation, eval-mode dropout.
NO_KERNEL = {
    f"aten::{name}"
    for name in (
        *("view", "as_strided", "resolve_conj", "resolve_neg", "empty", "empty_strided", "empty_like"),
        *("t", "transpose", "expand", "reshape", "_reshape_alias", "unsqueeze", "squeeze", "permute"),
        *("select", "slice", "split", "unbind", "detach", "alias", "_unsafe_view", "lift_fresh"),
        *("result_type", "promote_types", "unflatten", "flatten", "narrow", "chunk", "split_with_sizes"),
        *("view_as", "expand_as", "contiguous", "dropout", "size", "stride", "numel", "dim"),
    )
}
BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "int": 4, "bool": 1}


def _bytes(shape: list, dtype: str) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * BYTES.get(dtype, 4)


def census(call: Callable[[], object], calls: int = 2) -> dict[str, float]:
    """Per call: kernel-launching ops, casts among them, elements and MB cast, MB the ops read."""
    call()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as recorded:
        for _ in range(calls):
            call()
    ops, casts, cast_elements, cast_bytes, read = 0, 0, 0, 0, 0
    names: Counter[str] = Counter()
    for event in recorded.events():
        shapes, dtypes = event.input_shapes or [], event.input_dtypes or []
        if event.name == "aten::_to_copy" and shapes and shapes[0]:
            casts += 1
            cast_elements += _bytes(shapes[0], "bool")
            cast_bytes += _bytes(shapes[0], dtypes[0])
        if event.cpu_children or not event.name.startswith("aten::") or event.name in NO_KERNEL:
            continue
        ops += 1
        names[event.name] += 1
        read += sum(_bytes(s, d) for s, d in zip(shapes, dtypes, strict=False) if isinstance(s, list) and s)
    return {
        "kernel ops": ops / calls,
        "casts": casts / calls,
        "elements cast": cast_elements / calls,
        "MB cast (read)": cast_bytes / calls / 1e6,
        "MB read by the ops": read / calls / 1e6,
    }


def calls(arch: str, batch: int) -> dict[str, Callable[[], object]]:
    """The bfloat16 inference pass and the trainer's step in float32 and in bfloat16."""
    torch.manual_seed(0)
    engine = MemoryViT.from_timm(arch)
    x = torch.randn(batch, 3, *engine.spec.img_size, generator=torch.Generator().manual_seed(0))
    y = torch.arange(batch) % 10
    engine.train()
    made = {}
    for precision in ("float32", "bfloat16"):
        step = TrainStep(engine, variants(engine, x, 1, 10), precision=precision, rehearse=True)
        for _ in range(WARM_UP + 1):
            step(x, y)

        def stepped(step: TrainStep = step) -> None:
            step(x, y)
            step.pending.clear()

        made[f"step, {precision}"] = stepped
    torch.manual_seed(0)
    served_engine = MemoryViT.from_timm(arch, dtype=torch.bfloat16)
    served = served_engine.prepare_set(
        [made_variant.adapter.weights() for made_variant in variants(engine, x, 1, 10)]
    )
    x_served = x.to(torch.bfloat16)

    def infer() -> None:
        with torch.inference_mode():
            served_engine(x_served, served)

    return {"inference pass, bfloat16": infer, **made}


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--arch", default="deit_tiny_patch16_224")
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(environment(f"{args.arch} (random init), batch {args.batch}, 1 thread"))
    rows = {name: census(fn) for name, fn in calls(args.arch, args.batch).items()}
    columns = list(next(iter(rows.values())))
    print("| call | " + " | ".join(columns) + " |")
    print("|---|" + "--:|" * len(columns))
    for name, row in rows.items():
        print(
            f"| {name} | "
            + " | ".join(f"{row[c]:,.1f}" if row[c] % 1 else f"{row[c]:,.0f}" for c in columns)
            + " |"
        )


if __name__ == "__main__":
    main()
