"""Training on a CUDA device (``pytest -m cuda``; skipped without one): the graphed base pass replays
the eager one, the whole step as one graph ends where the eager step ends and launches one graph and
a handful of operations per step, a run on the GPU reaches the CPU run's numbers (float32) and stays
near them (bfloat16), the cache placements agree on the device, and the joint update equals torch's
SGD there."""

from __future__ import annotations

import pytest
import torch

from memvit.adapters.training import TrainConfig, scan_folder, train_adapter
from memvit.adapters.training.base_pass import BasePass
from memvit.adapters.training.cache import ActivationCache
from memvit.adapters.training.cache_key import CacheSpec
from memvit.adapters.training.cache_placement import PlacedCache
from memvit.adapters.training.device import to_device
from memvit.adapters.training.metrics import evaluate_tasks
from memvit.adapters.training.update import JointUpdate
from memvit.memory_core import LiveAdapters, MemoryViT
from memvit.memory_core.stored.cached import CachedBatch, capture
from tests.conftest import images, max_diff, tiny_engine

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
]
CUDA = torch.device("cuda", 0)


@pytest.fixture
def exact_float32():
    """cuDNN's TF32 convolutions off (the patch embedding), so float32 on the GPU is float32."""
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


def _config(folder, **overrides) -> TrainConfig:
    base = dict(name="colours", train_dir=str(folder), val_fraction=0.25, memory_tokens=2, steps=16)
    return TrainConfig(**{**base, "batch_size": 8, "lr": 0.1, "seed": 0, **overrides})


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_the_graphed_base_pass_replays_the_eager_one(precision: str, exact_float32) -> None:
    engine = tiny_engine().to(CUDA)
    graphed, eager = BasePass(engine, precision), BasePass(engine, precision, graphs=False)
    for seed in (1, 2, 3):  # the second and third calls replay the graph with new images
        x = images(engine, batch=6, seed=seed).to(CUDA)
        a, b = graphed(x), eager(x)
        assert a.layers.dtype == b.layers.dtype and a.layers.device == CUDA
        assert max_diff(a.layers, b.layers) <= 1e-5 and max_diff(a.base_logits, b.base_logits) <= 1e-5
    assert graphed.graphed and graphed.failed is None and len(graphed._graphs) == 1
    x = images(engine, batch=6).to(CUDA)
    _, layers = capture(engine, x, "inputs")
    if precision == "float32":
        assert max_diff(graphed(x).layers, layers) <= 1e-5


def _graph_variants(engine, x) -> list:
    from memvit.adapters.training.variant import Variant

    made = []
    for i, m in enumerate((0, 2, 3, 1)):
        config = TrainConfig(
            name=f"v{i}", train_dir="-", memory_tokens=m, lr=0.05 * (i + 1), steps=20,
            weight_decay=0.01 * (i % 2), clip_grad=(0.05, 1.0)[i % 2],
        )  # fmt: skip
        made.append(Variant(engine, config, ("a", "b", "c"), None, total=20, init_images=x[:2]))
    return made


@pytest.mark.parametrize("source", ["images", "cache"])
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_the_graphed_step_is_the_eager_step(source: str, precision: str, exact_float32) -> None:
    """The whole step (preparation, pass, way back, update) replayed as one graph, through a resume's
    new optimiser state (the graph dropped and captured again), ends where the eager step ends."""
    import copy

    from memvit.adapters.training.step import TrainStep
    from memvit.adapters.training.step_graph import WARM_UP

    runs = []
    for graphs in (True, False):
        engine = tiny_engine().to(CUDA).train()
        variants = _graph_variants(engine, images(engine, batch=6).to(CUDA))
        step = TrainStep(engine, variants, precision=precision, graphs=graphs)
        for i in range(2 * WARM_UP + 5):  # captured, replayed with new data, dropped, captured again
            if i == WARM_UP + 3:
                for v in variants:
                    v.optimizer.load_state_dict(copy.deepcopy(v.optimizer.state_dict()))
            batch = images(engine, batch=6, seed=10 + i).to(CUDA)
            if source == "cache":
                logits, layers = capture(engine, batch, "inputs")
                batch = CachedBatch("inputs", layers, logits)
            step(batch, torch.tensor([0, 1, 2, 2, 1, 0], device=CUDA))
            if graphs and i == WARM_UP + 2:
                assert step.path.graphed
        step.flush()
        assert step.path.graphed is graphs and step.path.failed is None
        runs.append(variants)
    for a, b in zip(*runs, strict=True):
        assert a.losses == pytest.approx(b.losses, abs=1e-5)
        for p, q in zip(a.adapter.parameters(), b.adapter.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_the_graphed_step_is_one_launch_and_waits_for_nothing() -> None:
    """Per step on the GPU: one graph launch, a handful of operations around it whatever the number
    of variants (tests/adapters/training/test_step_ops.py counts the same on the CPU), no host sync."""
    from benchmarks.gpu.step_ops import step_ops
    from memvit.adapters.training.step import TrainStep
    from memvit.adapters.training.step_graph import WARM_UP
    from tests.adapters.training.test_step_ops import OUTSIDE

    found = []
    for n in (1, 4):
        engine = tiny_engine().to(CUDA).train()
        x = images(engine, batch=6).to(CUDA)
        y = torch.tensor([0, 1, 2, 2, 1, 0], device=CUDA)
        step = TrainStep(engine, _graph_variants(engine, x)[:n])
        for _ in range(WARM_UP + 2):
            step(x, y)
        assert step.path.graphed, step.path.failed
        counts = step_ops(lambda step=step, x=x, y=y: step(x, y), steps=3, cuda=True)
        assert counts["graph launches"] == 1 and counts["host syncs"] == 0, counts
        assert counts["outside the graph"] <= OUTSIDE and counts["in the graph"] == 0, counts
        found.append(counts["outside the graph"])
    assert found[0] == found[1]


def test_a_run_on_the_gpu_reaches_the_cpu_runs_numbers(image_folder, tiny_weights, exact_float32) -> None:
    runs = {}
    for device, precision in (("cpu", "float32"), ("cuda", "float32"), ("cuda", "bfloat16")):
        engine = MemoryViT.from_timm(weights=str(tiny_weights))
        runs[device, precision] = train_adapter(
            engine, _config(image_folder, device=device, precision=precision), progress=False
        )
        assert engine.device.type == device
    cpu, gpu, bf16 = runs["cpu", "float32"], runs["cuda", "float32"], runs["cuda", "bfloat16"]
    assert gpu.losses == pytest.approx(cpu.losses, abs=1e-3)
    assert max_diff(gpu.bundle.weights.memory, cpu.bundle.weights.memory) <= 1e-3
    assert gpu.val.top1 == pytest.approx(cpu.val.top1, abs=1 / cpu.val.images + 1e-9)
    assert bf16.losses[-1] == pytest.approx(cpu.losses[-1], abs=0.1)
    assert abs(bf16.val.top1 - cpu.val.top1) <= 2 / cpu.val.images + 1e-9
    assert gpu.bundle.training["device"].startswith("cuda:0 (")
    assert all(t.device.type == "cpu" for t in gpu.bundle.tensors().values())  # loads anywhere


def test_the_regimes_path_in_float32_then_bfloat16_in_one_process(
    tmp_path, tiny_weights, exact_float32
) -> None:
    """benchmarks/train_regime.py's path as the GPU suite's ``same numbers`` runs it: float32, then
    bfloat16, in one process, decoded by workers, validated over many batches. float32 validation
    replays the engine's CUDA graphs, captured in CUDA's global mode while the loaders work: on an
    H200 that capture was invalidated (by the pin-memory thread's pinned allocations)."""
    from benchmarks.gpu.training_regime import _tiny_folders
    from benchmarks.train_regime import Regime, agreement, predictions

    regime = Regime(train_per_class=8, val_per_class=48, steps=6, batch_size=4, memory_tokens=1)
    root = _tiny_folders(tmp_path, regime)
    found = {}
    for device, precision in (("cpu", "float32"), ("cuda", "float32"), ("cuda", "bfloat16")):
        engine = MemoryViT.from_timm(weights=str(tiny_weights))
        config = regime.config(root, device=device, precision=precision, workers=4, eval_batch_size=4)
        result = train_adapter(engine, config, progress=False)
        found[precision, device] = result, predictions(engine, result, root / "val", precision)
        if (device, precision) == ("cuda", "float32"):  # validation ran through the engine's graphs
            assert engine._graphed_passes is not None and engine._graphed_passes.captures >= 1
    (cpu, cpu_says), (gpu, gpu_says), (bf16, bf16_says) = found.values()
    assert gpu.val.images == bf16.val.images == len(bf16_says) == 2 * regime.val_per_class
    assert gpu.val.top1 == pytest.approx(cpu.val.top1, abs=2 / cpu.val.images + 1e-9)
    assert agreement(gpu_says, cpu_says) >= 0.95
    assert bf16.bundle.training["hyper_parameters"]["precision"] == "bfloat16"


def test_every_cache_placement_gives_the_same_batches_on_the_device(tmp_path, image_folder) -> None:
    engine = tiny_engine().to(CUDA)
    samples = scan_folder(image_folder)
    cache = ActivationCache.open_or_build(CacheSpec(tmp_path / "c", views=2), engine, samples, progress=False)
    rows, views = [3, 0, 17, 3], [1, 0, 1, 0]
    expected = cache.batch(rows, views)
    for placement in ("device", "pinned", "disk"):
        placed = PlacedCache(cache, placement, CUDA)
        batch = placed.batch(rows, views)
        assert (batch.layers.device == CUDA) == (placement == "device")
        if placement != "device":
            assert batch.layers.is_pinned() and batch.base_logits.is_pinned()
        moved = to_device(batch, CUDA)
        assert torch.equal(moved.layers.cpu(), expected.layers)
        assert torch.equal(moved.base_logits.cpu(), expected.base_logits)


def test_training_from_a_cache_on_the_device_equals_from_disk(tmp_path, image_folder, tiny_weights) -> None:
    results = {}
    for placement in ("device", "pinned", "disk"):
        config = _config(
            image_folder, device="cuda", cache=str(tmp_path / "cache"), cache_placement=placement
        )
        results[placement] = train_adapter(
            MemoryViT.from_timm(weights=str(tiny_weights)), config, progress=False
        )
    for placement in ("pinned", "disk"):
        assert results[placement].losses == pytest.approx(results["device"].losses, abs=1e-6)
        assert results[placement].val == results["device"].val


def test_the_joint_update_equals_torchs_sgd_on_the_device() -> None:
    g = torch.Generator().manual_seed(0)
    made = [[torch.randn(5, 3, generator=g).to(CUDA).requires_grad_() for _ in range(3)] for _ in range(2)]
    twins = [[p.detach().clone().requires_grad_() for p in ps] for ps in made]
    joint = [
        torch.optim.SGD(ps, lr=0.1 * (i + 1), momentum=0.9, weight_decay=1e-3) for i, ps in enumerate(made)
    ]
    alone = [
        torch.optim.SGD(ps, lr=0.1 * (i + 1), momentum=0.9, weight_decay=1e-3) for i, ps in enumerate(twins)
    ]
    update = JointUpdate(joint, [0.5, 5.0])
    for step in range(3):
        grads = []
        for b in twins:
            for q in b:
                q.grad = torch.randn(q.shape, generator=g).to(CUDA) * (step + 1)
                grads.append(q.grad.clone())
        for o in joint + alone:
            o.param_groups[0]["lr"] *= 0.9  # a schedule's change, read from the device tensor
        update.load_rates()
        update(grads)
        for ps, optimizer, clip in zip(twins, alone, [0.5, 5.0], strict=True):
            torch.nn.utils.clip_grad_norm_(ps, clip)
            optimizer.step()
    for a, b in zip(made, twins, strict=True):
        for p, q in zip(a, b, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_eval_on_the_device_is_unchanged_by_fusing(tmp_path, image_folder, tiny_weights, precision) -> None:
    out = tmp_path / "a.safetensors"
    engine = MemoryViT.from_timm(weights=str(tiny_weights))
    train_adapter(engine, _config(image_folder, steps=4), out=out, progress=False)
    from memvit.adapters import attach_bundle

    live = LiveAdapters(MemoryViT.from_timm(weights=str(tiny_weights)).to(CUDA))
    attach_bundle(live, out)
    (report,) = evaluate_tasks(live, {"colours": image_folder}, precision=precision)
    assert report.unchanged and report.fused.images == 48
