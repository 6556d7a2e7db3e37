"""The slot pools' tensors at one generation (``SlotPools``), made and copied into larger ones.

``AdapterSlots`` (slots.py) says which adapter holds which slot and when the pools grow; this file
holds the tensors themselves and what a pass reads of them (docs/design.md §2.10).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..sets.stack import PreparedAdapter
from ..weights.spec import ViTSpec

_WHOLE = object()  # SlotPools.narrowed's mark for the pools' own width


@dataclass(frozen=True)
class SlotPools:
    """The pool tensors at one generation. A pass reads one ``SlotPools`` throughout."""

    keys: Tensor  # (L, S, H, P, d)
    values: Tensor  # (L, S, H, P, d)
    memory_bias: Tensor  # (S, P) 0 / -inf
    memory_length: Tensor  # (S,) int32
    cls: Tensor  # (S, D)
    head_weight: Tensor  # (S, C, D)
    head_bias: Tensor  # (S, C)
    generation: int
    _narrowed: dict = field(default_factory=dict, compare=False, repr=False)  # (P, C) -> views

    @property
    def capacity(self) -> int:
        return self.cls.shape[0]

    @property
    def memory(self) -> int:
        return self.keys.shape[3]

    @property
    def classes(self) -> int:
        return self.head_weight.shape[1]

    def narrowed(self, memory: int, classes: int) -> SlotPools:
        """Views of the pools with P = ``memory`` and C = ``classes``: what one pass reads.

        A pass is as wide as its own adapters need, not as wide as the widest resident one, so
        that its operations, and so its float rounding, do not depend on what else is loaded."""
        narrowed = self._narrowed.get((memory, classes))  # made once per width
        if narrowed is not None:
            return self if narrowed is _WHOLE else narrowed  # not self kept in self: no cycle to collect
        if memory > self.memory or classes > self.classes:
            raise ValueError(f"P={memory}, C={classes} exceed the pools' P={self.memory}, C={self.classes}")
        if memory == self.memory and classes == self.classes:
            self._narrowed[memory, classes] = _WHOLE
            return self
        return self._narrowed.setdefault((memory, classes), self._views(memory, classes))

    def _views(self, memory: int, classes: int) -> SlotPools:
        return SlotPools(
            keys=self.keys[..., :memory, :],
            values=self.values[..., :memory, :],
            memory_bias=self.memory_bias[:, :memory],
            memory_length=self.memory_length,
            cls=self.cls,
            head_weight=self.head_weight[:, :classes],
            head_bias=self.head_bias[:, :classes],
            generation=self.generation,
        )

    @property
    def nbytes(self) -> int:
        tensors = (self.keys, self.values, self.memory_bias, self.memory_length, self.cls)
        return sum(t.nbytes for t in (*tensors, self.head_weight, self.head_bias))


def allocate_pools(
    spec: ViTSpec,
    device: torch.device,
    dtype: torch.dtype,
    capacity: int,
    *,
    memory: int,
    classes: int,
    generation: int,
) -> SlotPools:
    """Empty pools: every slot the null slot (no memory, a zero class token, a zero head)."""
    like = {"device": device, "dtype": dtype}
    memory_shape = (spec.depth, capacity, spec.num_heads, memory, spec.head_dim)
    with torch.inference_mode(False):  # normal tensors, writable outside inference mode too
        return SlotPools(
            keys=torch.zeros(memory_shape, **like),
            values=torch.zeros(memory_shape, **like),
            memory_bias=torch.full((capacity, memory), float("-inf"), **like),
            memory_length=torch.zeros(capacity, device=device, dtype=torch.int32),
            cls=torch.zeros(capacity, spec.width, **like),
            head_weight=torch.zeros(capacity, classes, spec.width, **like),
            head_bias=torch.zeros(capacity, classes, **like),
            generation=generation,
        )


def copy_pools(old: SlotPools, new: SlotPools) -> None:
    """Every slot of ``old`` into the same slot of ``new`` (at least as many slots, as wide)."""
    S, P, C = old.capacity, old.memory, old.classes
    with torch.inference_mode(False), torch.no_grad():
        new.keys[:, :S, :, :P] = old.keys
        new.values[:, :S, :, :P] = old.values
        new.memory_bias[:S, :P] = old.memory_bias
        new.memory_length[:S] = old.memory_length
        new.cls[:S] = old.cls
        new.head_weight[:S, :C] = old.head_weight
        new.head_bias[:S, :C] = old.head_bias


def widths(memory: int, classes: int) -> tuple[int, int]:
    """The (P, C) a pass reads for adapters of at most ``memory`` memory entries and ``classes``
    classes: powers of two, a function of those adapters alone (the pools always hold them)."""
    return power_of_2(memory), power_of_2(classes)


def power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 0 else 0


def write_slots(
    pools: SlotPools, chains: list[tuple[PreparedAdapter, ...]], slots: list[int], memory: int, classes: int
) -> None:
    """Each chain (an adapter and its ancestors) into its slot of ``pools``, padded to their widths."""
    p = pools
    index = torch.tensor(slots, device=p.cls.device)
    # Pools are normal tensors written outside autograd, whether or not the caller runs in
    # inference mode (a pass assigns slots inside one, a server's install outside it).
    with torch.inference_mode(False), torch.no_grad():
        if memory:
            keys = torch.stack([_visible(c, "memory_keys") for c in chains], dim=1)
            values = torch.stack([_visible(c, "memory_values") for c in chains], dim=1)
            p.keys[:, index, :, :memory] = keys  # (L, n, H, m, d)
            p.values[:, index, :, :memory] = values
        p.keys[:, index, :, memory:] = 0
        p.values[:, index, :, memory:] = 0
        p.memory_bias[index, :memory] = 0
        p.memory_bias[index, memory:] = float("-inf")
        p.memory_length[index] = memory
        p.cls[index] = torch.stack([c[0].cls for c in chains])
        p.head_weight[index, :classes] = torch.stack([c[0].head_weight for c in chains])
        p.head_weight[index, classes:] = 0
        p.head_bias[index, :classes] = torch.stack([c[0].head_bias for c in chains])
        p.head_bias[index, classes:] = 0


def _visible(chain: tuple[PreparedAdapter, ...], field: str) -> Tensor:
    """A chain's visible memory keys or values (L, H, m, d): its own, then its ancestors'."""
    return (
        getattr(chain[0], field) if len(chain) == 1 else torch.cat([getattr(a, field) for a in chain], dim=2)
    )


def chain_sizes(chain: tuple[PreparedAdapter, ...]) -> tuple[int, int]:
    """A chain's (visible memory, classes)."""
    return sum(a.memory_keys.shape[2] for a in chain), chain[0].head_weight.shape[0]


def widest(chains: list[tuple[PreparedAdapter, ...]]) -> tuple[int, int]:
    """The most memory and the most classes among ``chains``."""
    sizes = [chain_sizes(c) for c in chains]
    return max(m for m, _ in sizes), max(c for _, c in sizes)
