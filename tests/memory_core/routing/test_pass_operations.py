"""What an inference pass dispatches: no operation that makes a device wait for the host, and the
same operations whatever adapters are resident or asked for (memory_core/routing/planned.py).

Counted with a ``TorchDispatchMode`` over the device part of a pass (the plan's copy to the device
and ``run_plan``); the Triton path's kernels are counted as launches beside its aten operations.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from memvit.memory_core import LiveAdapters, MemoryViT, plan_pass
from memvit.memory_core.routing import triton_kernels
from tests.conftest import images, random_adapter, tiny_engine

# Operations that copy a value to the host (a CUDA sync) or whose output size depends on values.
SYNCING = {
    "aten._local_scalar_dense",
    "aten.item",
    "aten.nonzero",
    "aten.nonzero_static",
    "aten.unique",
    "aten._unique",
    "aten._unique2",
    "aten.unique_consecutive",
    "aten.unique_dim",
    "aten.masked_select",
    "aten.is_nonzero",
    "aten.equal",
    "aten.allclose",
    "aten._assert_async",
}
# Operations that make no new data (views): not kernels.
VIEWS = {
    "aten.view", "aten._unsafe_view", "aten.reshape", "aten.flatten", "aten.slice", "aten.select",
    "aten.unsqueeze", "aten.squeeze", "aten.transpose", "aten.t", "aten.permute", "aten.expand",
    "aten.split", "aten.split_with_sizes", "aten.unbind", "aten.alias", "aten.detach", "aten.as_strided",
    "aten.promote_types", "aten.dropout",  # dropout in eval mode returns its input
}  # fmt: skip
# Per block, the kernels the class-token rows may add to timm's own, and what a pass may add once:
# Triton adds its kernel, the output buffer and the copy of the base rows' attention into it; with
# the products apart, each linear layer's second product and the output they share; per pass, the
# torch path's trimmed last block gathers the rows it keeps (block/merged.py ``merged_last_block``).
PER_BLOCK = {("torch", "joined"): 22, ("triton", "joined"): 3, ("torch", "apart"): 31, ("triton", "apart"): 9}
PER_PASS = 14


class Recorder(TorchDispatchMode):
    """Every aten operation dispatched (kernels: the ones that are not views), and any that would
    sync or index by a boolean mask."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.offending: list[str] = []

    @property
    def kernels(self) -> int:
        return sum(n for op, n in self.ops.items() if op not in VIEWS)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.ops[name] += 1
        if name in SYNCING or (name == "aten.repeat_interleave" and not (kwargs or {}).get("output_size")):
            self.offending.append(name)
        if name in ("aten.index", "aten.index_put", "aten.index_put_"):
            indices = args[1] if len(args) > 1 else ()
            if any(t is not None and t.dtype == torch.bool for t in indices):
                self.offending.append(f"{name} with a boolean mask")
        return func(*args, **(kwargs or {}))


def _unrecorded(fn):
    """A Triton kernel's launch, with the interpreter's own tensor work (on CPU) not recorded."""

    def launch(*args, **kwargs):
        with _disable_current_modes():
            return fn(*args, **kwargs)

    return launch


def count(engine: MemoryViT, x: torch.Tensor, live: LiveAdapters | None, tasks=None) -> Recorder:
    """The device part of one pass, planned outside the count (planning is host work)."""
    plan = None if live is None else plan_pass(live.current, engine.slots, tasks, x.shape[0])
    launches = triton_kernels.launches
    with pytest.MonkeyPatch.context() as patch:
        for name in ("class_token_attention_kernel", "gathered_heads", "shared_heads"):
            patch.setattr(triton_kernels, name, _unrecorded(getattr(triton_kernels, name)))
        with torch.inference_mode(), Recorder() as recorder:
            engine.run_plan(x, plan)
    recorder.ops["triton launch"] += triton_kernels.launches - launches
    return recorder


def loaded(engine: MemoryViT, k: int) -> LiveAdapters:
    live = LiveAdapters(engine)
    live.replace_all(random_adapter(f"a{i}", engine, m=1 + i % 3, classes=3 + i % 5) for i in range(k))
    return live


def ask(live: LiveAdapters, per_image: int, batch: int, seed: int = 0) -> list[list[str]]:
    """Random tasks per image, never the same for every image (that would be the shared layout)."""
    rng = random.Random(seed)
    while True:
        tasks = [rng.sample(live.current.names, per_image) for _ in range(batch)]
        if any(set(t) != set(tasks[0]) for t in tasks):
            return tasks


@pytest.fixture(params=[("torch", "joined"), ("triton", "joined"), ("torch", "apart"), ("triton", "apart")])
def engine(request) -> MemoryViT:
    # Triton's interpreter runs a Python program per image, head and row: two heads, not four, halve
    # them. What is counted (aten operations and launches, per block and per pass) does not depend on
    # the number of heads; the depth, which the per-block bounds multiply, stays.
    engine = tiny_engine(num_heads=2) if request.param[0] == "triton" else tiny_engine()
    engine.kernels, engine.row_gemms = request.param
    return engine


def batch_for(engine: MemoryViT) -> int:
    return 2 if engine.kernels == "triton" else 4  # Triton's interpreter is slow: fewer programs


def test_no_pass_waits_for_the_host(engine) -> None:
    n = batch_for(engine)
    x = images(engine, batch=n)
    live = loaded(engine, 6)
    for tasks in (None, ask(live, 1, n), ask(live, 3, n)):
        recorder = count(engine, x, live, tasks)
        assert recorder.offending == [], f"tasks={tasks}: {recorder.offending}"


def test_operations_do_not_depend_on_what_is_resident_or_asked(engine) -> None:
    n = batch_for(engine)
    x = images(engine, batch=n)
    few, many = loaded(engine, 8), loaded(engine, 300)
    one_of_few = count(engine, x, few, ask(few, 1, n)).ops
    one_of_many = count(engine, x, many, ask(many, 1, n, seed=1)).ops
    assert one_of_few == one_of_many  # 8 or 300 resident: the same operations
    eight_of_many = count(engine, x, many, ask(many, 8, n)).ops
    assert eight_of_many == one_of_many  # 1 or 8 tasks per image: the same operations
    # The all-tasks pass (the shared layout): its own fixed set, whatever the number of adapters.
    assert count(engine, x, loaded(engine, 3)).ops == count(engine, x, few).ops


def test_a_pass_adds_a_stated_constant_per_block_to_the_base(engine) -> None:
    n = batch_for(engine)
    x = images(engine, batch=n)
    base = count(engine, x, None).kernels
    live = loaded(engine, 8)
    depth = len(engine.base.blocks)
    for tasks in (None, ask(live, 1, n), ask(live, 5, n)):
        planned = count(engine, x, live, tasks).kernels
        per_block = PER_BLOCK[engine.kernels, engine.row_gemms]
        assert planned - base <= per_block * depth + PER_PASS, (tasks, planned, base)


# Operations that fill a buffer with a value (a memset or a fill kernel on a GPU).
FILLS = {
    "aten.zeros", "aten.zeros_like", "aten.new_zeros", "aten.zero_", "aten.fill_",
    "aten.full", "aten.full_like", "aten.new_full",
}  # fmt: skip


def test_no_block_fills_a_buffer(engine) -> None:
    """The planned pass's blocks write every buffer they allocate, never clear one first: the extra
    memsets of a GPU pass (the H200 profile: one or two per block with the rows joined) are issued
    inside cuBLASLt's ``addmm`` for the kernels it picks by row count, not by the engine. At most
    one fill per pass (the torch path's padded lineage table), whatever the depth."""
    n = batch_for(engine)
    x = images(engine, batch=n)
    live = loaded(engine, 8)
    assert len(engine.base.blocks) >= 2  # a fill per block would show as more than one
    for tasks in (None, ask(live, 2, n)):
        ops = count(engine, x, live, tasks).ops
        assert sum(ops[op] for op in FILLS) <= 1, {op: ops[op] for op in FILLS if ops[op]}


@pytest.mark.parametrize("routed", [False, True])
def test_a_pass_traces_as_one_graph(routed: bool) -> None:
    """torch.compile traces the device part of a routed and an unrouted pass with no graph break."""
    engine = tiny_engine("qknorm_layerscale_prenorm")
    live = loaded(engine, 6)
    x = images(engine, batch=3)
    tasks = ask(live, 2, 3) if routed else None
    plan = plan_pass(live.current, engine.slots, tasks, 3)
    tensors = plan.tensors(engine.device)

    def device_pass(x: torch.Tensor, tensors):
        from memvit.memory_core.routing.planned import planned_forward

        trim = engine.resolved_trim  # the pass as the engine runs it (trimmed on the CPU)
        return planned_forward(engine.base, engine.embed(x), tensors, plan.shape, plan.pools, trim=trim)

    torch._dynamo.reset()
    compiled = torch.compile(device_pass, fullgraph=True, backend="eager")  # raises on a graph break
    with torch.inference_mode():
        base, adapters = compiled(x, tensors)
        expected = engine.run_plan(x, plan)
    assert torch.equal(base, expected[0]) and torch.equal(adapters, expected[1])
