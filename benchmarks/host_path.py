"""The host's part of a graphed pass, measured on a CPU: aten ops, host syncs, events, microseconds.

On a GPU a planned pass is one CUDA-graph replay; what the host does around it (planning, copies,
reading the output) decides whether the GPU waits for it (memory_core/routing/graphs.py, plan.py). This
runs the very path a GPU pass takes, on this CPU, with the parts this CPU lacks stood in: the graph's
replay is a no-op (its outputs are the captured pass's), "pinned" host buffers are plain memory and
events are counting stand-ins that say a copy has run at once. Per pass it reports:

- aten ops dispatched (outside the graph: all of them, the replay being a no-op), and how many of
  them touch host tensors only (CPU kernels on a GPU's host, where torch's intra-op pool has a thread
  per core);
- host syncs: ``.item()``/``.tolist()``, ``nonzero``-like ops, ``synchronize()`` calls and copies to
  the device from pageable memory (a stand-in device tensor written from a host tensor that is not
  one of the pinned buffers);
- events created;
- host microseconds per pass; to the (first) launch (what the host does before the replay: the part a
  synced GPU pass waits for with the GPU idle; what follows the launch, the outputs' copies and the
  output object, overlaps the GPU's work); to the last launch (a planned pass with the embedding
  ahead: its tokens' graph, after the plan and its copy; the GPU idles from the embedding's end to
  it when this is longer than the embedding's own time, the device's gaps on an H200's DeiT-Tiny,
  RESULTS §1.8); and the plan's alone.

Cases: base only; fused (every adapter) K = 8, 64, 1,000; routed 1 and 8 of 1,000 per image; at
batch 4, 64 and 256, on a tiny base (the host path does not depend on the model's size).

    python -m benchmarks.host_path            # the table and each goal PASS/MISS
    python -m benchmarks.host_path --quick    # fewer batches and repetitions (CI's smoke)
    python -m benchmarks.host_path --one-graph     # planned passes as one graph (the default is two:
                                                   # the embedding's launched before the plan)
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

from benchmarks.common import argument_parser, environment
from benchmarks.host_counts import HostCounts, StandInEvent, StandInGraphs, counting
from memvit.memory_core import LiveAdapters, MemoryViT, TaskIndex, plan_pass
from memvit.memory_core.routing.graphs import bucket_images, bucket_rows
from memvit.memory_core.routing.staging import HostBuffers
from tests.factories import random_adapter, tiny_engine

# A base whose pass is cheap to capture: the host path is the same for any size.
SMALL = dict(img_size=16, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=10)
GOALS = {"aten ops": 6, "host ops": 0, "host syncs": 0, "events created": 0}
PLAN_GOALS_US = {  # (case, batch) -> the plan's microseconds at most; "fused 1000" at any batch
    ("fused K=1000", None): 20,
    ("routed 1 of 1000", 64): 100,
    ("routed 8 of 1000", 64): 150,
    ("routed 8 of 1000", 256): 600,
}


@dataclass
class Row:
    case: str
    batch: int
    aten_ops: int
    host_ops: int
    host_syncs: int
    events_created: int
    pass_us: float
    launch_us: float
    last_launch_us: float  # the pass's last graph launch (the tokens' graph, after the plan)
    plan_us: float


def stand_in_engine(
    adapters: int, *, replays: bool = False, ahead: bool | None = None
) -> tuple[MemoryViT, LiveAdapters, StandInGraphs]:
    """A tiny engine whose passes run the graphed host path with nothing replayed (``replays``: the
    pass run again in place of the replay; ``ahead``: ``engine.embed_ahead``, None for its default)."""
    engine = tiny_engine(**SMALL)
    if ahead is not None:
        engine.embed_ahead = ahead
    buffers = HostBuffers(pinned=False, new_event=StandInEvent.factory())
    graphs = StandInGraphs(buffers=buffers, replays=replays)
    engine.use_graphs(graphs)
    live = LiveAdapters(engine)
    live.replace_all(random_adapter(f"a{i}", engine, m=1, classes=10) for i in range(adapters))
    return engine, live, graphs


def routed_asks(live: LiveAdapters, per_image: int, batch: int, seed: int) -> TaskIndex:
    """What a batcher builds for ``batch`` one-image requests of ``per_image`` random tasks each."""
    rng = random.Random(seed)
    names = live.current.names
    return TaskIndex.join(
        [TaskIndex.uniform(live.current, rng.sample(names, per_image), 1) for _ in range(batch)]
    )


def measure(engine, live, graphs, case: str, batch: int, asks, repeats: int) -> Row:
    x = torch.randn(batch, 3, *engine.spec.img_size)
    adapter_set = None if case == "base" else live.current
    tasks = [None] if asks is None else asks
    with torch.inference_mode():
        for t in tasks[:2]:  # capture the graphs this case replays
            engine(x, adapter_set, tasks=t)
        counts = HostCounts(device_tensors=[x])
        with counting(counts, graphs):
            engine(x, adapter_set, tasks=tasks[0])
        times, launches, lasts, plans = [], [], [], []
        buffers = engine._graphs().buffers
        for i in range(repeats):
            t = tasks[i % len(tasks)]
            graphs.launches.clear()
            started = time.perf_counter()
            engine(x, adapter_set, tasks=t)
            times.append(time.perf_counter() - started)
            launches.append(graphs.launches[0] - started)  # the device's first work
            lasts.append(graphs.launches[-1] - started)  # ahead: the GPU idles from the embedding's end
        # The plans in a loop of their own: timed right after a pass, they read a cache the stand-in's
        # CPU clone of the outputs (16 MB for all 1,000 tasks at batch 256) has just flushed, which a
        # GPU pass, whose outputs stay on the device, never does.
        for i in range(repeats if adapter_set is not None else 0):
            t = tasks[i % len(tasks)]
            started = time.perf_counter()
            plan = plan_pass(
                adapter_set, engine.slots, t, batch, images=bucket_images, rows=bucket_rows,
                pad_outputs=True, buffers=buffers,
            )  # fmt: skip
            plans.append(time.perf_counter() - started)
            buffers.release(plan.buffer)
    return Row(
        case, batch, counts.aten_ops, sum(counts.host_ops.values()), counts.syncs, counts.events_created,
        statistics.median(times) * 1e6, statistics.median(launches) * 1e6, statistics.median(lasts) * 1e6,
        statistics.median(plans) * 1e6 if plans else 0.0,
    )  # fmt: skip


def run(batches: list[int], repeats: int, ahead: bool | None = None) -> list[Row]:
    rows = []
    for k in (8, 64, 1000):
        engine, live, graphs = stand_in_engine(k, ahead=ahead)
        for batch in batches:
            if k == 8:
                rows.append(measure(engine, live, graphs, "base", batch, None, repeats))
            rows.append(measure(engine, live, graphs, f"fused K={k}", batch, None, repeats))
            if k == 1000:
                for per in (1, 8):
                    asks = [routed_asks(live, per, batch, seed) for seed in range(4)]
                    rows.append(measure(engine, live, graphs, f"routed {per} of 1000", batch, asks, repeats))
    return rows


def verdicts(rows: list[Row]) -> list[str]:
    """Each goal, PASS or MISS, with the worst row."""
    out = []
    fields = {
        "aten ops": "aten_ops",
        "host ops": "host_ops",
        "host syncs": "host_syncs",
        "events created": "events_created",
    }
    for label, field in fields.items():
        worst = max(rows, key=lambda r: getattr(r, field))
        value, goal = getattr(worst, field), GOALS[label]
        verdict = "PASS" if value <= goal else "MISS"
        out.append(f"{label} <= {goal}: {verdict} (most {value}: {worst.case}, b{worst.batch})")
    for (case, batch), goal in PLAN_GOALS_US.items():
        picked = [r for r in rows if r.case == case and (batch is None or r.batch == batch)]
        if picked:
            worst = max(picked, key=lambda r: r.plan_us)
            ok = worst.plan_us <= goal
            out.append(f"plan {case}{'' if batch is None else f' b{batch}'} <= {goal} us: "
                       f"{'PASS' if ok else 'MISS'} ({worst.plan_us:.1f} us at b{worst.batch})")  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--quick", action="store_true", help="batches 4 and 64, fewer repetitions")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument(
        "--one-graph",
        action="store_true",
        help="engine.embed_ahead off: a planned pass as one graph, planned before any launch",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    batches = [4, 64] if args.quick else [4, 64, 256]
    rows = run(batches, repeats=20 if args.quick else 200, ahead=False if args.one_graph else None)
    print(f"# host path of a graphed pass, replay stubbed ({environment()})")
    print(
        f"{'case':<20} {'batch':>5} {'aten ops':>8} {'host ops':>8} {'syncs':>5} {'events':>6} "
        f"{'pass us':>8} {'launch us':>9} {'last us':>8} {'plan us':>8}"
    )
    for r in rows:
        print(f"{r.case:<20} {r.batch:>5} {r.aten_ops:>8} {r.host_ops:>8} {r.host_syncs:>5} "
              f"{r.events_created:>6} {r.pass_us:>8.1f} {r.launch_us:>9.1f} {r.last_launch_us:>8.1f} "
              f"{r.plan_us:>8.1f}")  # fmt: skip
    for line in verdicts(rows):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
