"""The old import path of the Ray Serve application, kept for deployments that name it.

``serve run memvit.server.ray_serve:app`` and an ``import_path`` of ``memvit.server.ray_serve:app``
get the same application as ``memvit.server.ray.serve:app`` (server/ray/serve.py), where it lives.
"""

from __future__ import annotations

from .ray.serve import AFFINITY_ROUTER, REPLICA_HEADER, MemvitDeployment, app, replica_settings

__all__ = ["AFFINITY_ROUTER", "REPLICA_HEADER", "MemvitDeployment", "app", "replica_settings"]
