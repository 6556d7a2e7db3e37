"""Adapter bundles (``memvit.adapter/1``): the file format, strict reading, and attaching to an engine.

Depends on ``memory_core`` only; never on the HTTP service.
"""

from .attach import attach_bundle, check_compatible
from .bundle import FORMAT, AdapterBundle, bundle_for, save_bundle, write_atomic
from .errors import BaseMismatchError, BundleError, BundleFormatError, BundleMetadataError, BundleTensorError
from .reader import read_bundle

__all__ = [
    "FORMAT",
    "AdapterBundle",
    "BaseMismatchError",
    "BundleError",
    "BundleFormatError",
    "BundleMetadataError",
    "BundleTensorError",
    "attach_bundle",
    "bundle_for",
    "check_compatible",
    "read_bundle",
    "save_bundle",
    "write_atomic",
]
