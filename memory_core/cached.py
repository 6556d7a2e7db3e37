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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from timm.layers import Attention
from timm.models.vision_transformer import VisionTransformer
from torch import Tensor, nn

from .adapter_set import AdapterSet
from .attention import BaseKeys, KeysValues, base_block, class_token_block, project_qkv, softmax_dtype
from .errors import AdapterShapeError, InputError
from .output import FusedOutput
from .spec import ViTSpec

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


class _TimesStored(torch.autograd.Function):
    """``a @ x`` (or ``a @ x^T``) for a stored constant ``x``, widened to ``a``'s dtype where it is used.

    The backward pass widens ``x`` again instead of keeping the widened copy: per layer the copy is a
    few MB, made and read while it is still in cache, where a copy kept for the backward pass would
    come back from main memory (and the whole batch would stay allocated at twice its size). Reading
    the stored layers is most of a cached step's memory traffic.
    """

    @staticmethod
    def forward(ctx, a: Tensor, x: Tensor, transpose: bool) -> Tensor:
        ctx.save_for_backward(x)
        ctx.transpose = transpose
        wide = x.to(a.dtype)
        return a @ (wide.transpose(-1, -2) if transpose else wide)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        (x,) = ctx.saved_tensors
        wide = x.to(grad.dtype)
        return grad @ (wide if ctx.transpose else wide.transpose(-1, -2)), None, None


@dataclass(frozen=True)
class StoredKeysValues:
    """One layer's cached base keys and values, each (B, H, T, d) in the storage dtype."""

    keys: Tensor
    values: Tensor

    def attend(self, attn: Attention, q: Tensor, other: Tensor) -> tuple[Tensor, Tensor]:
        T = self.keys.shape[-2]
        scores = torch.cat([_TimesStored.apply(q, self.keys, True), other], dim=-1)
        probs = scores.softmax(dim=-1, dtype=softmax_dtype(q.dtype)).to(q.dtype)
        return _TimesStored.apply(probs[..., :T], self.values, False), probs[..., T:]


class _AttendInputs(torch.autograd.Function):
    """The class tokens' attention over one layer's base tokens, from their stored normed inputs h
    (B, T, D): keys and values are never formed. With W_k, W_v (H, d, D) and biases b_k, b_v (H, 1, d):

        scores = (q W_k).h + q.b_k             the query folded into W_k
        p      = softmax([scores ; other])     one softmax with the lineage and memory scores
        o      = (p h) W_v^T + (sum p) b_v     the weighted sum folded into W_v

    Forward and backward are written out in one function: h is widened once per pass and read twice
    while it is still in cache, and none of the small steps in between records an autograd node
    (about 30 fewer per layer and step). The base is frozen: only q and the other scores get gradients.
    """

    @staticmethod
    def forward(ctx, q: Tensor, other: Tensor, h: Tensor, w_k, b_k, w_v, b_v, dtype) -> tuple[Tensor, Tensor]:
        B, H, K, _ = q.shape
        T = h.shape[1]
        wide = h.to(q.dtype)
        u = torch.einsum("bhkd,hde->bhke", q, w_k).reshape(B, H * K, -1)  # (B, H*K, D)
        scores = torch.bmm(u, wide.transpose(1, 2)).view(B, H, K, T) + (q * b_k).sum(-1, keepdim=True)
        p = torch.cat([scores, other], dim=-1).softmax(dim=-1, dtype=dtype).to(q.dtype)
        p_x = p[..., :T]
        ph = torch.bmm(p_x.reshape(B, H * K, T), wide).view(B, H, K, -1)  # (B, H, K, D)
        o = torch.einsum("bhke,hde->bhkd", ph, w_v) + p_x.sum(-1, keepdim=True) * b_v
        ctx.save_for_backward(q, h, p, w_k, b_k, w_v, b_v)
        ctx.dtype = dtype
        return o, p[..., T:]

    @staticmethod
    def backward(ctx, grad_o: Tensor, grad_other: Tensor) -> tuple[Tensor | None, ...]:
        q, h, p, w_k, b_k, w_v, b_v = ctx.saved_tensors
        B, H, K, _ = q.shape
        T = h.shape[1]
        wide = h.to(q.dtype)
        grad_ph = torch.einsum("bhkd,hde->bhke", grad_o, w_v).reshape(B, H * K, -1)
        grad_p = torch.empty_like(p)
        grad_p[..., :T] = torch.bmm(grad_ph, wide.transpose(1, 2)).view(B, H, K, T)
        grad_p[..., :T] += (grad_o * b_v).sum(-1, keepdim=True)
        grad_p[..., T:] = grad_other
        pw, gw = p.to(ctx.dtype), grad_p.to(ctx.dtype)
        grad_s = (pw * (gw - (gw * pw).sum(-1, keepdim=True))).to(q.dtype)  # through the softmax
        grad_x = grad_s[..., :T]
        grad_u = torch.bmm(grad_x.reshape(B, H * K, T), wide).view(B, H, K, -1)
        grad_q = torch.einsum("bhke,hde->bhkd", grad_u, w_k) + grad_x.sum(-1, keepdim=True) * b_k
        return grad_q, grad_s[..., T:], None, None, None, None, None, None


@dataclass(frozen=True)
class NormedInputs:
    """One layer's base tokens held as their normed inputs h (B, T, D), in the storage dtype."""

    h: Tensor

    def attend(self, attn: Attention, q: Tensor, other: Tensor) -> tuple[Tensor, Tensor]:
        H, d, width = attn.num_heads, attn.head_dim, attn.attn_dim
        w_k, w_v = attn.qkv.weight[width:].view(2, H, d, -1)  # (H, d, D) each
        bias = attn.qkv.bias
        b_k, b_v = q.new_zeros(2, H, 1, d) if bias is None else bias[width:].view(2, H, 1, d)
        if w_k.requires_grad:
            raise ValueError("the cached path trains adapters over a frozen base; this base requires grad")
        return _AttendInputs.apply(q, other, self.h, w_k, b_k, w_v, b_v, softmax_dtype(q.dtype))


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
        return FusedOutput(batch.base_logits, {}, {}, adapter_set)
    if stack.cls.device != engine.device or stack.cls.dtype != engine.dtype:
        raise AdapterShapeError(
            f"these adapters were prepared for {stack.cls.device}/{stack.cls.dtype}, the engine runs "
            f"{engine.device}/{engine.dtype}",
            field="name",
        )
    base = engine.base
    layers = batch.layers.to(engine.device)
    c = base.norm_pre(stack.cls).expand(len(batch), -1, -1)  # (B, K, D)
    for i, (block, memory) in enumerate(zip(base.blocks, stack.layers, strict=True)):
        c = class_token_block(block, c, _base_keys(block, batch.store, layers[:, i], engine.dtype), memory)
    heads = stack.apply_heads(base.norm(c))
    return FusedOutput.every_image(
        batch.base_logits.to(engine.device), dict(zip(adapter_set.names, heads, strict=True)), adapter_set
    )
