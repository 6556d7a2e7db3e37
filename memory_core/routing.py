"""Per-image task routing: each image pays for the adapters it asks for, not for every one loaded.

A ``Route`` picks, for each image b, the adapters whose class-token rows the fused pass builds: the
ones the image asks for plus, in extension mode, their ancestors (an extension's class token attends
to its ancestors' class tokens, so they must be computed too, though they are not returned unless
asked). Images may ask for different adapters; every image gets R rows, R being the most any image
needs, and an image that needs fewer repeats its first row (computed and discarded: no -inf rows,
no NaN). Each row's attention reads its own image's base keys and its own adapter's memory, so a
row's logits do not depend on which other rows share the pass (docs/design.md §2.7).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from .adapter_set import AdapterSet
from .attention import LayerMemory
from .errors import InputError
from .stack import stack_adapters


class RouteOutput(NamedTuple):
    """One asked adapter's logits in a routed pass: its head, the images asking, and their rows."""

    name: str
    weight: Tensor  # (C_k, D) head weight
    bias: Tensor  # (C_k,)
    images: Tensor  # (n,) long: the images asking for it, ascending
    rows: Tensor  # (n,) long: where its class-token row sits among each of those images' R rows


@dataclass(frozen=True)
class Route:
    """Which class-token rows a pass builds for a batch, and where each asked task's logits come from."""

    cls: Tensor  # (B, R, D): each row's initial class token
    layers: tuple[LayerMemory, ...]  # per block, routed: keys (B, R, H, P, d), lineage (B, R, A)
    outputs: tuple[RouteOutput, ...]  # per asked adapter, in the set's order

    @property
    def requires_grad(self) -> bool:
        tensors = [self.cls, *(t for layer in self.layers for t in (layer.keys, layer.values))]
        return any(t.requires_grad for t in tensors)


def build_route(adapter_set: AdapterSet, tasks: Sequence[Collection[str]], batch: int) -> Route | None:
    """The rows for ``batch`` images where image b asks for the adapters named in ``tasks[b]``.

    Only the adapters some image needs are stacked (not the whole set: a batch asking for 3 of
    1,000 loaded adapters touches 3). Returns None when no image asks for any adapter (a base-only
    pass). Unknown names raise ``UnknownAdapterError``.
    """
    if len(tasks) != batch:
        raise InputError(f"tasks: {len(tasks)} entries for {batch} images; give one collection per image")
    adapters = adapter_set.adapters
    lineages: dict[int, list[int]] = {}  # per asked adapter: itself and its ancestors (set indices)
    asked: list[list[int]] = []
    needed: list[list[int]] = []
    for names in tasks:
        if isinstance(names, str):
            raise InputError("tasks: give each image a collection of adapter names, not a string")
        ks = sorted({adapter_set.index(name) for name in names})  # raises for an unknown name
        asked.append(ks)
        for k in ks:
            if k not in lineages:
                lineages[k] = [adapter_set.index(n) for n in adapter_set.lineage(adapters[k].name)]
        needed.append(sorted({j for k in ks for j in lineages[k]}))
    used = sorted({k for rows in needed for k in rows})  # the set's order: parents before children
    if not used:
        return None
    stack = stack_adapters(tuple(adapters[k] for k in used))
    local = {k: i for i, k in enumerate(used)}
    needed = [[local[k] for k in rows] for rows in needed]
    R = max(len(rows) for rows in needed)
    device = stack.cls.device
    # (B, R) stacked index of each row; short images repeat their first row (none: row 0, unused).
    padded = [rows + [rows[0]] * (R - len(rows)) if rows else [0] * R for rows in needed]
    idx = torch.tensor(padded, dtype=torch.long, device=device)
    # Where each stacked adapter's row sits in its image's row list (-1: not there).
    position = torch.full((batch, len(used)), -1, dtype=torch.long, device=device)
    for b, rows in enumerate(needed):
        at = torch.tensor(rows, dtype=torch.long, device=device)
        position[b, at] = torch.arange(len(rows), device=device)
    images = torch.arange(batch, device=device)[:, None]
    layers = tuple(_routed(layer, idx, position, images) for layer in stack.layers)
    askers: dict[int, list[int]] = {}
    for b, ks in enumerate(asked):
        for k in ks:
            askers.setdefault(k, []).append(b)
    outputs = []
    for k in sorted(askers):  # the set's order
        who = torch.tensor(askers[k], dtype=torch.long, device=device)
        weight, bias = stack.heads[local[k]]
        outputs.append(RouteOutput(adapters[k].name, weight, bias, images=who, rows=position[who, local[k]]))
    return Route(cls=stack.cls[idx], layers=layers, outputs=tuple(outputs))


def _routed(layer: LayerMemory, idx: Tensor, position: Tensor, images: Tensor) -> LayerMemory:
    """One layer's memory gathered per image: row r of image b gets adapter idx[b, r]'s memory."""
    lineage = position[images.expand_as(idx)[..., None], layer.lineage[idx]]  # (B, R, A) rows
    lineage_bias = layer.lineage_bias[idx]
    # Padding entries of a lineage point at the adapter itself (always present); -1 never survives
    # where the bias is 0, because every ancestor of a needed row is needed too.
    lineage = torch.where(lineage < 0, torch.zeros_like(lineage), lineage)
    return LayerMemory(
        keys=layer.keys[idx],  # (B, R, H, P, d)
        values=layer.values[idx],
        bias=layer.bias[idx],  # (B, R, P)
        lineage=lineage,
        lineage_bias=lineage_bias,
    )
