"""The fused pass: base logits are timm's, adapter logits are the dense oracle's and their own."""

from __future__ import annotations

import dataclasses

import pytest
import timm
import torch

from memvit.memory_core import AdapterSet, InputError, LiveAdapters, MemoryViT, create_base
from memvit.memory_core.oracle.reference import DenseMemoryViT
from tests.conftest import TOL, VARIANTS, images, max_diff, random_adapter, tiny_engine


@pytest.mark.parametrize("path", ["merged", "split"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("num_adapters", [0, 1, 16])
def test_base_logits_equal_timm(variant: str, num_adapters: int, path: str) -> None:
    engine = tiny_engine(variant)
    x = images(engine)
    expected = engine.base(x)
    loaded = engine.prepare_set(
        random_adapter(f"a{i}", engine, m=i % 4, memory_norm=("norm1", "none")[i % 2])
        for i in range(num_adapters)
    )
    out = engine(x, loaded, path=path)
    assert max_diff(out.base, expected) <= TOL
    assert len(out.adapters) == num_adapters


def test_without_a_set_the_engine_runs_the_base_alone(engine) -> None:
    x = images(engine)
    out = engine(x)
    assert out.adapters == {} and max_diff(out.base, engine.base(x)) <= TOL


def test_base_logits_equal_timm_unfused_attention_kernel() -> None:
    # timm falls back to explicit softmax attention when fused attention is off; mirror it exactly.
    engine = tiny_engine()
    for block in engine.base.blocks:
        block.attn.fused_attn = False
    x = images(engine)
    expected = engine.base(x)
    loaded = engine.prepare_set([random_adapter("a", engine, m=2)])
    assert max_diff(engine(x, loaded).base, expected) <= TOL


def test_distilled_deit_base_unchanged() -> None:
    base = create_base("deit_tiny_distilled_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=4)
    engine = MemoryViT(base)
    x = images(engine)
    expected = engine.base(x)
    loaded = engine.prepare_set([random_adapter("a", engine, m=3)])
    assert max_diff(engine(x, loaded).base, expected) <= TOL


@pytest.mark.parametrize("path", ["merged", "split"])
@pytest.mark.parametrize("memory_norm", ["norm1", "none"])
@pytest.mark.parametrize("m", [0, 1, 5])
@pytest.mark.parametrize("variant", ["plain", "registers"])
def test_adapter_logits_equal_dense_oracle(memory_norm: str, m: int, variant: str, path: str) -> None:
    engine = tiny_engine(variant)
    adapters = [random_adapter(f"a{i}", engine, m=m, memory_norm=memory_norm) for i in range(3)]
    x = images(engine)
    out = engine(x, engine.prepare_set(adapters), path=path)
    base_ref, adapter_ref = DenseMemoryViT(engine.base, adapters)(x)
    assert max_diff(out.base, base_ref) <= TOL
    for a in adapters:
        assert max_diff(out.adapters[a.name], adapter_ref[a.name]) <= TOL


def test_mixed_memory_sizes_and_norms_in_one_set() -> None:
    engine = tiny_engine("qknorm_layerscale_prenorm")
    adapters = [
        random_adapter("m0", engine, m=0),
        random_adapter("m1-none", engine, m=1, memory_norm="none"),
        random_adapter("m5", engine, m=5, classes=11),
        random_adapter("m3-none", engine, m=3, memory_norm="none", classes=2),
    ]
    x = images(engine)
    out = engine(x, engine.prepare_set(adapters))
    _, ref = DenseMemoryViT(engine.base, adapters)(x)
    for a in adapters:
        assert out.adapters[a.name].shape == (x.shape[0], a.num_classes)
        assert max_diff(out.adapters[a.name], ref[a.name]) <= TOL


def test_prepare_many_equals_prepare_one_by_one() -> None:
    """Batched projection (start-up with many bundles) gives each adapter what prepare gives it alone."""
    engine = tiny_engine("qknorm_layerscale_prenorm")
    weights = [
        random_adapter(f"a{i}", engine, m=m, memory_norm=norm)
        for i, (m, norm) in enumerate([(0, "norm1"), (1, "none"), (5, "norm1"), (3, "none"), (2, "norm1")])
    ]
    for one, many in zip(
        [engine.prepare(w) for w in weights], engine.prepare_many(weights, chunk=2), strict=True
    ):
        assert many.name == one.name and many.weights is one.weights
        assert many.memory_keys.shape == one.memory_keys.shape
        assert torch.allclose(many.memory_keys, one.memory_keys, rtol=0, atol=1e-6)
        assert torch.allclose(many.memory_values, one.memory_values, rtol=0, atol=1e-6)
        assert torch.equal(many.cls, one.cls) and torch.equal(many.head_weight, one.head_weight)


@pytest.mark.parametrize("memory_norm", ["norm1", "none"])
@pytest.mark.parametrize("m", [0, 1, 5])
def test_adapter_logits_do_not_depend_on_other_adapters(memory_norm: str, m: int) -> None:
    engine = tiny_engine("registers")
    x = images(engine)
    target = random_adapter("target", engine, m=m, memory_norm=memory_norm)
    alone = engine(x, engine.prepare_set([target])).adapters["target"]

    others = [
        random_adapter(f"o{i}", engine, m=i % 6, memory_norm=("norm1", "none")[i % 2]) for i in range(15)
    ]
    loaded = engine.prepare_set([*others[:7], target, *others[7:]])
    among = engine(x, loaded).adapters["target"]
    assert len(loaded) == 16

    for other in others:
        loaded = loaded.without(other.name)
    after = engine(x, loaded).adapters["target"]
    assert loaded.names == ("target",)

    _, ref = DenseMemoryViT(engine.base, [target])(x)
    assert max_diff(alone, among) <= TOL
    assert max_diff(alone, after) <= TOL
    assert max_diff(alone, ref["target"]) <= TOL


@pytest.mark.parametrize("path", ["merged", "split"])
def test_extension_chain_matches_oracle_and_parents_ignore_children(path: str) -> None:
    engine = tiny_engine()
    root = random_adapter("root", engine, m=2)
    child = random_adapter("child", engine, m=1, parent="root", memory_norm="none")
    grandchild = random_adapter("grandchild", engine, m=3, parent="child")
    sibling = random_adapter("sibling", engine, m=4, parent="root")
    loner = random_adapter("loner", engine, m=0)
    adapters = [root, loner, child, sibling, grandchild]
    x = images(engine)
    out = engine(x, engine.prepare_set(adapters), path=path)
    _, ref = DenseMemoryViT(engine.base, adapters)(x)
    for a in adapters:
        assert max_diff(out.adapters[a.name], ref[a.name]) <= TOL, a.name

    # A parent never sees its extensions: alone it gives the same logits.
    alone = engine(x, engine.prepare_set([root]))
    assert max_diff(alone.adapters["root"], out.adapters["root"]) <= TOL
    # An extension does see its parent: the same child weights over a different parent differ.
    other_root = random_adapter("root", engine, m=2, seed=99)
    moved = engine(x, engine.prepare_set([other_root, child]))
    assert max_diff(moved.adapters["child"], out.adapters["child"]) > 1e-3


def test_memory_changes_adapter_logits_but_not_base() -> None:
    engine = tiny_engine()
    x = images(engine)
    with_memory = random_adapter("a", engine, m=5)
    without_memory = random_adapter("a", engine, m=0)  # same seed: same class token and head
    assert torch.equal(with_memory.cls_token, without_memory.cls_token)
    out_mem = engine(x, engine.prepare_set([with_memory]))
    out_plain = engine(x, engine.prepare_set([without_memory]))
    assert max_diff(out_mem.adapters["a"], out_plain.adapters["a"]) > 1e-2
    assert max_diff(out_mem.base, out_plain.base) == 0.0


def test_memory_norm_placement_is_honoured() -> None:
    engine = tiny_engine()
    x = images(engine)
    normed = random_adapter("a", engine, m=3, memory_norm="norm1")
    raw = random_adapter("a", engine, m=3, memory_norm="none")
    assert torch.equal(normed.memory, raw.memory)
    a = engine(x, engine.prepare_set([normed])).adapters["a"]
    b = engine(x, engine.prepare_set([raw])).adapters["a"]
    assert max_diff(a, b) > 1e-3


def test_real_deit_tiny(deit_tiny_path) -> None:
    reference = timm.create_model("deit_tiny_patch16_224", num_classes=1000)
    reference.load_state_dict(timm.models.load_state_dict(str(deit_tiny_path)))
    reference.eval()
    engine = MemoryViT.from_timm(weights=str(deit_tiny_path))  # architecture from the file's metadata
    assert engine.spec.arch == "deit_tiny_patch16_224"
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(x)
        for k in (0, 1, 16):
            adapters = [random_adapter(f"a{i}", engine, m=i % 3, memory_std=0.1) for i in range(k)]
            out = engine(x, engine.prepare_set(adapters))
            assert max_diff(out.base, expected) <= TOL, k
        _, ref = DenseMemoryViT(engine.base, adapters)(x)
        for a in adapters:
            assert max_diff(out.adapters[a.name], ref[a.name]) <= TOL


def test_unknown_path_is_refused(engine) -> None:
    loaded = engine.prepare_set([random_adapter("a", engine)])
    with pytest.raises(ValueError, match="path must be"):
        engine(images(engine), loaded, path="dense")


def test_wrong_images_are_refused(engine) -> None:
    with pytest.raises(InputError, match="32x32"):
        engine(torch.zeros(1, 3, 64, 64))
    with pytest.raises(InputError, match="B, 3, H, W"):
        engine(torch.zeros(1, 1, 32, 32))


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 0.06), (torch.float16, 0.01)])
def test_half_precision_on_cpu(dtype: torch.dtype, tol: float) -> None:
    # Low precision: logits (of magnitude ~2 here) within `tol` of float32; measured 0.02 for bf16
    # and 0.0023 for fp16, so the bounds leave 3-4x headroom.
    engine = tiny_engine()
    adapters = [random_adapter(f"a{i}", engine, m=i) for i in range(3)]
    live = LiveAdapters(engine)
    live.replace_all(adapters)
    x = images(engine)
    full = engine(x, live.current)
    live.move_to(dtype=dtype)
    assert live.current.stack.cls.dtype == dtype  # adapters were re-prepared for the new dtype
    half = engine(x, live.current)
    assert half.base.dtype == dtype
    assert max_diff(half.base, full.base) <= tol
    for a in adapters:
        assert max_diff(half.adapters[a.name], full.adapters[a.name]) <= tol


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.06), (torch.float16, 0.01)])
def test_cuda_matches_cpu(dtype: torch.dtype, tol: float) -> None:
    """The engine's arithmetic on CUDA is the CPU's up to reduction order, with TF32 off. torch's
    defaults leave cuDNN's TF32 convolutions on (the patch embedding: 10 bits of mantissa, measured
    3.7e-4 on these logits on an H200), which the server turns off (``exact_float32``); with the
    defaults float32 is held to 1e-3."""
    engine = tiny_engine()
    adapters = [random_adapter(f"a{i}", engine, m=i, memory_norm=("norm1", "none")[i % 2]) for i in range(4)]
    live = LiveAdapters(engine)
    live.replace_all(adapters)
    x = images(engine)
    cpu = engine(x, live.current)
    live.move_to("cuda", dtype)
    defaults = engine(x.cuda(), live.current)
    conv, matmul = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
        engine._graphs().clear()  # captured with the defaults' kernels: capture again
        exact = engine(x.cuda(), live.current)
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = conv, matmul
        engine._graphs().clear()
    for gpu, bound in ((exact, tol), (defaults, max(tol, 1e-3))):
        assert max_diff(gpu.base.cpu(), cpu.base) <= bound
        for a in adapters:
            assert max_diff(gpu.adapters[a.name].cpu(), cpu.adapters[a.name]) <= bound


def test_gradients_never_flow_through_the_base_rows() -> None:
    # docs/design.md §2.3: when the adapter tensors are trained, autograd must record only the class-token
    # rows; the base tokens come out of the pass as plain constants.
    engine = tiny_engine()
    prepared = engine.prepare(random_adapter("a", engine, m=2))
    trainable = dataclasses.replace(prepared, cls=prepared.cls.clone().requires_grad_())
    stack = AdapterSet((trainable,)).stack
    x_tokens, c_tokens = engine.forward_features(images(engine), stack)
    assert c_tokens.requires_grad and not x_tokens.requires_grad
    c_tokens.sum().backward()
    assert trainable.cls.grad is not None and trainable.cls.grad.abs().sum() > 0
    assert all(p.grad is None for p in engine.base.parameters())
    with torch.no_grad():  # no gradients wanted: the merged inference path, same numbers
        merged = engine.forward_features(images(engine), stack)[1]
    assert max_diff(merged, c_tokens.detach()) <= TOL


@pytest.mark.parametrize("path", ["merged", "split"])
def test_float64_engine_is_float64_accurate(path: str) -> None:
    # The adapter softmax runs in the wider of float32 and the engine's dtype: a float64 engine must
    # match the float64 dense reference far below float32's rounding (it was 1.8e-7 with a float32
    # softmax), including extension chains.
    engine = tiny_engine().to(torch.float64)
    adapters = [
        random_adapter("root", engine, m=3),
        random_adapter("child", engine, m=2, parent="root", memory_norm="none"),
        random_adapter("plain", engine, m=0),
    ]
    adapters = [
        dataclasses.replace(
            a, **{k: getattr(a, k).double() for k in ("memory", "cls_token", "head_weight", "head_bias")}
        )
        for a in adapters
    ]
    x = images(engine).double()
    out = engine(x, engine.prepare_set(adapters), path=path)
    _, ref = DenseMemoryViT(engine.base, adapters)(x)
    for a in adapters:
        assert max_diff(out.adapters[a.name].double(), ref[a.name].double()) <= 1e-12, a.name
