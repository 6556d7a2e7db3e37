"""An adapter set: an immutable snapshot of adapters, swapped whole by the live set (engine/live.py).

A fused pass reads the engine's current ``AdapterSet`` once and uses only that object, so adding or
removing an adapter (which builds a new set and swaps one reference) can never change a pass that
is already running, and a response can never mix two sets. Everything the fused pass needs is
stacked once, when the set is built, not on every pass.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from ..errors import (
    AdapterInUseError,
    DuplicateAdapterError,
    MissingParentError,
    UnknownAdapterError,
)
from .stack import AdapterStack, PreparedAdapter, stack_adapters

_versions = itertools.count(1)


class AdapterSet:
    """An immutable, ordered set of prepared adapters.

    ``version`` identifies the set: unique per set built in this process, unless the caller gives
    one (the server gives its registry's version, the journal's head, so replicas serving one registry
    report one number).
    """

    __slots__ = ("_by_name", "_names", "_requires_grad", "_stack", "_table", "adapters", "version")

    def __init__(self, adapters: tuple[PreparedAdapter, ...] = (), *, version: int | None = None) -> None:
        self.adapters = tuple(adapters)
        self._by_name = {a.name: i for i, a in enumerate(self.adapters)}
        if len(self._by_name) != len(self.adapters):
            raise DuplicateAdapterError("adapter names in a set must be unique", field="name")
        for a in self.adapters:
            if a.parent is not None and a.parent not in self._by_name:
                raise MissingParentError(
                    f"adapter {a.name!r} extends {a.parent!r}, which is not loaded; load the parent first",
                    field="parent",
                )
        # Stacked for the all-tasks pass on first use, not here: adding or removing one adapter among
        # thousands builds a new set in about a millisecond, and routed passes never need it (they
        # read the device slots the engine keeps, memory_core/routing/slots.py).
        self._stack: AdapterStack | None = None
        self._requires_grad: bool | None = None
        self._table = None  # its SlotTable on one engine's slots (routing/slot_table.py, table_of)
        self._names = tuple(a.name for a in self.adapters)
        self.version = next(_versions) if version is None else version

    @property
    def stack(self) -> AdapterStack | None:
        """Every adapter stacked for the fused pass (None when the set is empty); built once."""
        if self._stack is None and self.adapters:
            self._stack = stack_adapters(self.adapters, group_heads=True)
        return self._stack

    @property
    def requires_grad(self) -> bool:
        """True when some adapter of the set is being trained (one of its tensors requires grad):
        such a set runs through its stack, not the device slots (``MemoryViT.forward``)."""
        if self._requires_grad is None:
            self._requires_grad = any(
                t.requires_grad
                for a in self.adapters
                for t in (a.cls, a.memory_keys, a.memory_values, a.head_weight, a.head_bias)
            )
        return self._requires_grad

    # -- reading -------------------------------------------------------------------------------
    @property
    def names(self) -> tuple[str, ...]:
        return self._names

    def __len__(self) -> int:
        return len(self.adapters)

    def __iter__(self) -> Iterator[PreparedAdapter]:
        return iter(self.adapters)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def index(self, name: str) -> int:
        """Position of adapter ``name`` in the set (UnknownAdapterError when it is not loaded)."""
        try:
            return self._by_name[name]
        except KeyError:
            raise UnknownAdapterError(f"no adapter named {name!r} is loaded", field="name") from None

    def __getitem__(self, name: str) -> PreparedAdapter:
        try:
            return self.adapters[self._by_name[name]]
        except KeyError:
            raise UnknownAdapterError(f"no adapter named {name!r} is loaded", field="name") from None

    def __repr__(self) -> str:
        return f"AdapterSet(version={self.version}, names={list(self.names)})"

    def dependents(self, name: str) -> list[str]:
        """Adapters that extend ``name`` directly."""
        return [a.name for a in self.adapters if a.parent == name]

    def lineage(self, name: str) -> list[str]:
        """``name`` followed by its ancestors, nearest first."""
        chain = [name]
        while (parent := self[chain[-1]].parent) is not None:
            chain.append(parent)
        return chain

    # -- deriving new sets ---------------------------------------------------------------------
    def check_add(self, adapter: PreparedAdapter, *, replace: bool = False) -> None:
        """Raise what ``with_adapter`` would raise, without building the new set's stack."""
        name = adapter.name
        if adapter.parent is not None and adapter.parent not in self._by_name:
            raise MissingParentError(
                f"adapter {name!r} extends {adapter.parent!r}, which is not loaded; load the parent first",
                field="parent",
            )
        if name not in self._by_name:
            return
        if not replace:
            raise DuplicateAdapterError(
                f"an adapter named {name!r} is already loaded; remove it first or ask to replace it",
                field="name",
            )
        if users := self.dependents(name):
            raise AdapterInUseError(
                f"cannot replace {name!r}: {users} extend it and were trained against the current version",
                field="name",
            )

    def with_adapter(self, adapter: PreparedAdapter, *, replace: bool = False) -> AdapterSet:
        """A new set with ``adapter`` added (or, with ``replace``, swapped in at the same position)."""
        self.check_add(adapter, replace=replace)
        if adapter.name not in self._by_name:
            return AdapterSet((*self.adapters, adapter))
        adapters = list(self.adapters)
        adapters[self._by_name[adapter.name]] = adapter
        return AdapterSet(tuple(adapters))

    def at_version(self, version: int) -> AdapterSet:
        """The same adapters under another version number (the stack is shared, not rebuilt)."""
        renumbered = object.__new__(AdapterSet)
        for name in ("adapters", "_by_name", "_names", "_stack", "_requires_grad", "_table"):
            setattr(renumbered, name, getattr(self, name))
        renumbered.version = version
        return renumbered

    def check_remove(self, name: str) -> None:
        """Raise what ``without`` would raise, without building the new set's stack."""
        self[name]  # raises UnknownAdapterError
        if users := self.dependents(name):
            raise AdapterInUseError(
                f"cannot remove {name!r}: {users} extend it; remove them first", field="name"
            )

    def without(self, name: str) -> AdapterSet:
        """A new set without ``name``."""
        self.check_remove(name)
        return AdapterSet(tuple(a for a in self.adapters if a.name != name))
