"""The training pass from images in bfloat16: the frozen base held in bfloat16, the adapters' rows
under autocast (``MixedPass``); the base held so (``HeldBase``) is also what bfloat16 evaluation
and bfloat16 activation caches run (base_pass.py, cache.py).

Under autocast over the float32 base (what the step ran before), every linear layer cast its float32
weight to bfloat16 on every call, twice a block (the base rows, then the class-token rows: the split
path runs them apart), and every norm returned float32 that the next layer cast back: a float32
residual stream, and per DeiT-Tiny step 557 casts of 27.5 M elements at batch 8 (the float32 step
makes 2; ViT-B/16 at batch 2: 187 M elements, the ops reading 6.9x the bytes of a bfloat16
inference pass; benchmarks/train_step_casts.py). A bfloat16 engine, which holds its weights in
bfloat16, casts none of that. On an H200 the bfloat16 step took 2.9 inference passes at DeiT-Tiny
batch 64 and 1.6-1.9 at ViT-B/16, against 1.1-1.4 in float32.

So the base rows run as a bfloat16 engine runs them: through a bfloat16 copy of the frozen base,
made once per run (half the float32 base's memory), without autocast: no weight is cast again, the
residual stream stays bfloat16. Each norm of the copy is held twice (``HeldNorm``): in bfloat16 for
a bfloat16 input, the base rows, as a bfloat16 engine holds it, and in float32 for a float32 input,
the class-token rows. Neither device takes both dtypes in one norm call: CUDA's layer norm refuses
float32 scales with a bfloat16 input ("expected scalar type BFloat16 but found Float",
pytorch/pytorch#135969), which a copy with float32 norms gave its base rows: the five bfloat16
trainer tests that failed on an H200 ran it (their messages were not kept); the CPU's refuses
bfloat16 scales with a float32 input, which the class-token rows give a bfloat16 norm (the CPU's
autocast leaves layer norms alone; CUDA's computes them in float32). The class-token rows, which
carry the gradients, run under autocast as before, reading the copy's weights: autocast casts a
float32 weight to the same bfloat16 values the copy holds and their norms read the same float32
scales, so those rows compute what they did, but for the base keys and values they read, now from a
bfloat16 base as a bfloat16 engine serves them (and a LayerScale's scales, which autocast leaves
alone, now read rounded to bfloat16). Now per step: 311 casts, all in the class-token rows (1.7 M
elements at DeiT-Tiny batch 8, the images' own cast included), and 1.2-1.3x an inference pass's
bytes read. The adapters' parameters, gradients and optimiser stay float32. Float32 runs never come
here: they run the engine's own split path, bit for bit as before.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from memvit.memory_core import AdapterSet, MemoryViT
from memvit.memory_core.block.attention import KeysValues, base_block, class_token_block

from .device import PRECISIONS, autocast

NORMS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)


class HeldNorm(nn.Module):
    """A norm of the held base, held in two dtypes: a ``dtype`` input (the base rows) is normed with
    scales in ``dtype``, as an engine in that dtype norms it; any other input (the class-token rows'
    float32) with the original float32 scales."""

    def __init__(self, norm: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.full = norm
        self.low = copy.deepcopy(norm).to(dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.low(x) if x.dtype == self.dtype else self.full(x)


def held_in(engine: MemoryViT, dtype: torch.dtype) -> nn.Module:
    """A copy of the engine's frozen base in ``dtype``, as an engine in that dtype holds it, except
    that each norm is a ``HeldNorm``: in ``dtype`` for the base rows, float32 for the class-token
    rows. Eval mode (no dropout, as ``MemoryViT.train`` keeps the base), no gradients; the engine's
    own base is left as it is."""
    # The converted tensors go in deepcopy's memo, so they are the copy's: no float32 copy of the
    # whole base is made first (at ViT-L on a full GPU, that one could be the allocation too many).
    converted: dict[int, Tensor] = {}
    for module in engine.base.modules():
        if isinstance(module, NORMS):
            continue
        for p in module.parameters(recurse=False):
            if p.is_floating_point():
                converted[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=False)
        for b in module.buffers(recurse=False):
            if b.is_floating_point():
                converted[id(b)] = b.detach().to(dtype)
    held = copy.deepcopy(engine.base, converted)
    norms = [(parent, name) for parent in held.modules() for name, child in parent.named_children()]
    for parent, name in norms:
        child = getattr(parent, name)
        if isinstance(child, NORMS):
            setattr(parent, name, HeldNorm(child, dtype))
    return held.eval().requires_grad_(False)


class HeldBase:
    """The engine's frozen base held in a precision's dtype (``held_in``): what ``capture`` and the
    pass read of an engine (``spec``, ``base``, ``device``, ``dtype``, ``embed``)."""

    def __init__(self, engine: MemoryViT, precision: str) -> None:
        if precision == "float32":
            raise ValueError("float32 runs the engine's own base")
        self.engine, self.spec, self.dtype = engine, engine.spec, PRECISIONS[precision]
        self.base = held_in(engine, self.dtype)

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def embed(self, x: Tensor) -> Tensor:
        """Images (B, C, H, W) -> the base tokens (B, T, D) in the held dtype (``MemoryViT.embed``)."""
        self.engine._check_input(x)
        base = self.base
        return base.norm_pre(base.patch_drop(base._pos_embed(base.patch_embed(x.to(self.dtype)))))


class MixedPass:
    """Images (B, C, H, W) and a set of adapters that train -> each adapter's logits (B, C_k), the
    base in ``precision`` (held so once), the class-token rows under that precision's autocast."""

    def __init__(self, engine: MemoryViT, precision: str) -> None:
        self.held, self.precision = HeldBase(engine, precision), precision

    def __call__(self, x: Tensor, adapter_set: AdapterSet) -> dict[str, Tensor]:
        stack = adapter_set.stack
        if stack is None:
            raise ValueError("a training pass needs adapters")
        base, device = self.held.base, x.device
        with torch.no_grad():  # the base rows: no autograd, no autocast
            x = self.held.embed(x)  # (B, T, D)
        with autocast(device, self.precision):
            c = base.norm_pre(stack.cls.expand(x.shape[0], -1, -1))  # (B, K, D)
        for block, memory in zip(base.blocks, stack.layers, strict=True):
            with torch.no_grad():
                x, _, k, v = base_block(block, x)  # (B, T, D); keys and values (B, H, T, d)
            with autocast(device, self.precision):
                c = class_token_block(block, c, KeysValues(k, v), memory)
        with autocast(device, self.precision):
            heads = stack.apply_heads(base.norm(c))
        return dict(zip(adapter_set.names, heads, strict=True))
