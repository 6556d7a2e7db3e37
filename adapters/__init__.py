"""Adapters as files and how they are made: two rooms, over two shared helpers.

Rooms, lowest first (a module may import its own room and those before it; tests/test_import_graph.py):

    files, preprocess  durable file writes (atomic, fsynced); the base's image preprocessing (decode,
                       eval transform), shared by training and the server.
    bundle             the bundle format (``memvit.adapter/1``): writing, strict reading, errors,
                       attaching to an engine. Its public names are this package's.
    training           making adapters: fine-tuning on an image folder (from images or an activation
                       cache), sweeps, checkpoints, accuracy (``memvit.adapters.training``, ``memvit train``).

Depends on ``memory_core`` only; never on the HTTP service.
"""

from .bundle.attach import attach_bundle, check_compatible
from .bundle.errors import (
    BaseMismatchError,
    BundleError,
    BundleFormatError,
    BundleMetadataError,
    BundleTensorError,
)
from .bundle.format import FORMAT, AdapterBundle, bundle_for, save_bundle, write_atomic
from .bundle.reader import read_bundle

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
