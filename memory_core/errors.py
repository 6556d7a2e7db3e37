"""Named errors of the engine.

Every error a caller can provoke is one of these, so the layers above (the bundle loader, the HTTP
service) can map them to messages and status codes in one place. Each message says what was wrong
and, where it helps, what to do about it.
"""

from __future__ import annotations


class MemvitError(Exception):
    """Root of every error memvit raises on purpose."""


class UnsupportedModelError(MemvitError):
    """The base model cannot host memory adapters (no class token, unknown block type, ...)."""


class WeightsError(MemvitError):
    """The base model's weights file is missing, unreadable or does not fit the architecture."""


class AdapterError(MemvitError):
    """An adapter cannot be added, replaced or removed. ``field`` names the offending part."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class InvalidAdapterError(AdapterError):
    """An adapter's own fields are invalid: name, parent, memory_norm, labels, or tensors that do not fit
    each other or hold NaN/inf. Raised by ``AdapterWeights``, the one place that checks them."""


class AdapterShapeError(InvalidAdapterError):
    """An adapter's tensors do not fit each other or the base model (depth, width, head)."""


class DuplicateAdapterError(AdapterError):
    """An adapter of that name is already loaded and replacing was not asked for."""


class UnknownAdapterError(AdapterError):
    """No adapter of that name is loaded."""


class MissingParentError(AdapterError):
    """An extension adapter names a parent that is not loaded."""


class AdapterInUseError(AdapterError):
    """The adapter is the parent of loaded extension adapters, so it cannot be removed or replaced."""


class InputError(MemvitError):
    """Images of the wrong shape, channel count or device for this model."""
