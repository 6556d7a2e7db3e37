"""The old import path of the adapter-affinity request router, kept for deployments that name it.

``request_router_class: memvit.server.ray_router:AdapterAffinityRouter`` is the same class as
``memvit.server.ray.router:AdapterAffinityRouter`` (server/ray/router.py), where it lives.
"""

from __future__ import annotations

from .ray.router import AdapterAffinityRouter

__all__ = ["AdapterAffinityRouter"]
