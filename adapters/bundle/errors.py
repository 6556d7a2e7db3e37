"""Named errors of the bundle format. All are ``AdapterError``s, so callers can catch one family.

``field`` names the metadata key or tensor at fault, for error responses that point at it.
"""

from __future__ import annotations

from memvit.memory_core.errors import AdapterError


class BundleError(AdapterError):
    """A bundle cannot be used. Subclasses say which part is wrong."""


class BundleFormatError(BundleError):
    """Not a safetensors file, a truncated one, or not a ``memvit.adapter/1`` bundle."""


class BundleMetadataError(BundleError):
    """A metadata entry is missing or invalid (name, labels, memory_norm, parent, ...)."""


class BundleTensorError(BundleError):
    """A tensor is missing, unexpected, of the wrong shape or dtype, or holds NaN/inf."""


class BaseMismatchError(BundleError):
    """The bundle was made for another base: architecture, fingerprint, depth or width differ."""
