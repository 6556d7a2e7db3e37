"""The adapters' class-token path from cached base activations (docs/design.md §2.9).

Base tokens never see adapter tokens (§1.1), so for a fixed image what the base computes at every
layer is the same for every adapter, every step and every epoch. ``capture`` runs the base once per
image and returns what the class-token path reads of each layer; ``forward_cached`` then runs only
that path (every adapter of a set, fused) from it. Training from a cache costs the class-token rows
alone, forward and back, about 1/T of the base pass per adapter.

What is kept per image (the ``store``):

- ``"inputs"``: the normed layer inputs h = norm1(x_l), (L, T, D). Keys and values are affine in h
  (k = h W_k^T + b_k, v = h W_v^T + b_v), so a class token never needs the T keys themselves:
  q.k = (q W_k).h + q.b_k and p.v = (p h) W_v^T + (sum p) b_v (``NormedInputs``). Half the bytes of
  keys and values, and no projection of the base rows; the scores cost H times those of stored keys
  (each head reads the D-wide h, not its d-wide slice), which is small while K * H < D. A base with a
  key norm (``qk_norm``) cannot fold its queries into W_k: its keys and values are projected from h.
- ``"keys-values"``: the keys and values themselves, (L, 2, H, T, d): twice the bytes, and the very
  tensors the split path reads (float32 storage gives its numbers bit for bit).

How the class tokens read a stored layer is in memory_core/stored/stored_attention.py; the common block runs
as one autograd node with its backward pass written out (memory_core/stored/cached_block.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import Tensor, nn

from ..block.attention import BaseKeys, KeysValues, LayerMemory, base_block, memory_rows, project_qkv
from ..errors import AdapterShapeError, InputError
from ..output.fused import FusedOutput
from ..sets.adapter_set import AdapterSet
from ..weights.spec import ViTSpec
from .cached_block import stored_class_token_block
from .stored_attention import NormedInputs, StoredKeysValues

STORES = ("inputs", "keys-values")


class Engine(Protocol):
    """What of ``MemoryViT`` this module uses (the engine calls in here: it is not imported)."""

    spec: ViTSpec
    base: VisionTransformer

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def embed(self, x: Tensor) -> Tensor: ...


def stored_shape(spec: ViTSpec, store: str) -> tuple[int, ...]:
    """The shape of one image's cached activations."""
    L, T, D = spec.depth, spec.num_tokens, spec.width
    if store == "inputs":
        return (L, T, D)
    if store == "keys-values":
        return (L, 2, spec.num_heads, T, spec.head_dim)
    raise ValueError(f"store must be one of {', '.join(STORES)}, got {store!r}")


@torch.no_grad()
def capture(engine: Engine, x: Tensor, store: str) -> tuple[Tensor, Tensor]:
    """Images (B, C, H, W) -> the base logits (B, C_0) and each image's activations (B, *stored_shape).

    The base runs exactly as in the split path (``attention.base_block``), so a cache holds what that
    path computes."""
    stored_shape(engine.spec, store)  # refuses an unknown store before any work
    base = engine.base
    t = engine.embed(x)
    layers = []
    for block in base.blocks:
        t, h, k, v = base_block(block, t)
        layers.append(h if store == "inputs" else torch.stack([k, v], dim=1))
    return base.forward_head(base.norm(t)), torch.stack(layers, dim=1)


@dataclass(frozen=True)
class CachedBatch:
    """A batch of cached activations, as ``forward_cached`` reads them."""

    store: str
    layers: Tensor  # (B, *stored_shape), any float dtype (float16 storage stays float16 until read)
    base_logits: Tensor  # (B, C_0)

    def __len__(self) -> int:
        return self.layers.shape[0]


def _base_keys(block: nn.Module, store: str, layer: Tensor, dtype: torch.dtype) -> BaseKeys:
    """One layer of a batch (B, ...), in the storage dtype -> how the class tokens read it."""
    attn = block.attn
    if store == "keys-values":
        return StoredKeysValues(layer[:, 0], layer[:, 1])
    dropout = attn.training and attn.attn_drop.p > 0  # only the keys-and-values path applies it
    if isinstance(attn.k_norm, nn.Identity) and not dropout:
        return NormedInputs(layer)
    _, k, v = project_qkv(attn, layer.to(dtype))  # a key norm sits between h and the scores: project
    return KeysValues(k, v)


def forward_cached(engine: Engine, batch: CachedBatch, adapter_set: AdapterSet) -> FusedOutput:
    """The fused pass from cached activations: the base logits as cached, every adapter's logits
    computed from the cached layers (with autograd when the set's tensors require grad)."""
    expected = stored_shape(engine.spec, batch.store)
    if tuple(batch.layers.shape[1:]) != expected:
        raise InputError(
            f"cached activations of shape {tuple(batch.layers.shape[1:])} per image, this base reads "
            f"{expected} ({batch.store})"
        )
    stack = adapter_set.stack
    if stack is None:
        return FusedOutput(batch.base_logits, adapter_set)
    if stack.cls.device != engine.device or stack.cls.dtype != engine.dtype:
        raise AdapterShapeError(
            f"these adapters were prepared for {stack.cls.device}/{stack.cls.dtype}, the engine runs "
            f"{engine.device}/{engine.dtype}",
            field="name",
        )
    base = engine.base
    layers = batch.layers.to(engine.device)
    c = base.norm_pre(stack.cls).expand(len(batch), -1, -1)  # (B, K, D)
    memories = stack.layers
    if batch.store == "inputs":  # the written-out block reads the memory's rows beside the base's
        memories = _with_memory_rows(base.blocks, adapter_set, stack.layers)
    for i, (block, memory) in enumerate(zip(base.blocks, memories, strict=True)):
        c = stored_class_token_block(
            block, c, _base_keys(block, batch.store, layers[:, i], engine.dtype), memory
        )
    heads = stack.apply_heads(base.norm(c))
    return FusedOutput.every_image(
        batch.base_logits.to(engine.device), dict(zip(adapter_set.names, heads, strict=True)), adapter_set
    )


def _with_memory_rows(
    blocks: nn.Sequential, adapter_set: AdapterSet, layers: tuple[LayerMemory, ...]
) -> tuple[LayerMemory, ...]:
    """The stack's layers with their memory's rows, which the written-out block reads. Training's
    stacked projection keeps them; a set prepared without them (evaluation: serving keeps keys and
    values only) gets them here, in concatenation mode: each adapter's ``attention.memory_rows``,
    padded as its keys are. One norm per layer and memory_norm, for all adapters."""
    first = layers[0]
    if first.inputs is not None or first.lineage.ndim != 2 or first.lineage.shape[-1] != 1:
        return layers
    adapters = adapter_set.adapters
    K, _, P, _ = first.keys.shape
    D = adapters[0].cls.shape[-1]
    rows = first.keys.new_zeros(len(layers), K, P, D)
    for norm in {a.weights.memory_norm for a in adapters}:
        members = [
            k for k, a in enumerate(adapters) if a.weights.memory_norm == norm and a.weights.num_memory
        ]
        if not members:
            continue
        memory = torch.cat([adapters[k].weights.memory for k in members], dim=1).to(rows)  # (L, Σm, D)
        memory = torch.stack([memory_rows(block, m, norm) for block, m in zip(blocks, memory, strict=True)])
        sizes = [adapters[k].weights.num_memory for k in members]
        for k, part in zip(members, memory.split(sizes, dim=1), strict=True):
            rows[:, k, : part.shape[1]] = part
    return tuple(replace(layer, inputs=r) for layer, r in zip(layers, rows.unbind(0), strict=True))
