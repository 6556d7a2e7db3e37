"""Putting bundles on an engine's live set: the checks that need the base, then one atomic swap."""

from __future__ import annotations

from pathlib import Path

from memvit.memory_core import AdapterSet, AdapterShapeError, LiveAdapters, MemoryViT

from .errors import BaseMismatchError
from .format import AdapterBundle
from .reader import read_bundle


def check_compatible(bundle: AdapterBundle, engine: MemoryViT) -> None:
    """Raise ``BaseMismatchError`` unless ``bundle`` was made for the base ``engine`` serves.

    The bundle names its base (architecture and fingerprint); the adapter's depth and width are
    ``AdapterWeights.check_fits``'s to judge.
    """
    spec, w = engine.spec, bundle.weights
    if bundle.base_model != spec.arch:
        raise BaseMismatchError(
            f"adapter {w.name!r} was trained on {bundle.base_model}, this model is {spec.arch}",
            field="base_model",
        )
    try:
        w.check_fits(spec)
    except AdapterShapeError as exc:
        raise BaseMismatchError(str(exc), field=exc.field) from exc
    if bundle.base_fingerprint != engine.fingerprint:
        raise BaseMismatchError(
            f"adapter {w.name!r} was trained on other {spec.arch} weights "
            f"(fingerprint {bundle.base_fingerprint[:12]}..., this base is {engine.fingerprint[:12]}...)",
            field="base_fingerprint",
        )


def attach_bundle(
    live: LiveAdapters, source: AdapterBundle | str | Path | bytes, *, replace: bool = False
) -> AdapterSet:
    """Validate ``source`` completely against ``live``'s engine, then make it live. Returns the new
    set; on any error the live set is unchanged."""
    bundle = source if isinstance(source, AdapterBundle) else read_bundle(source)
    check_compatible(bundle, live.engine)
    return live.add(bundle.weights, replace=replace)
