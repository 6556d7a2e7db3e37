"""One real two-node Ray cluster for the package's Serve tests (test_serve*.py), started by the first
test that asks for it and stopped after the last: see test_serve.py for what it is and checks."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="package")
def ray_auth_mode() -> Iterator[None]:
    """Ray's token authentication, named rather than guessed, for the nodes (which inherit this
    environment) and this driver: Ray 2.60 turns it on by itself on a head that finds
    ~/.ray/auth_token (any local ray.init() writes one) but not on a node joining it, which is then
    refused. Off, because this driver reads the mode once, when ray is imported; the cluster lives
    for this package on loopback addresses (its GCS port listens on every interface, as Ray's does)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_AUTH_MODE", "disabled")
        yield


@pytest.fixture(scope="package")
def cluster(s3_env, tiny_weights, ray_auth_mode, tmp_path_factory) -> Iterator[object]:
    pytest.importorskip("ray.serve", reason="the Ray Serve tests need the ray extra (ray[serve])")
    from tests.server.ray.cluster import running_cluster

    yield from running_cluster(s3_env, tiny_weights, tmp_path_factory)
