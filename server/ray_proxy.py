"""The old import path of the Ray proxy's middlewares, kept for deployments that name it.

``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=memvit.server.ray_proxy:proxy_middlewares`` gets the same
function as ``memvit.server.ray.proxy:proxy_middlewares`` (server/ray/proxy.py), where it lives.
"""

from __future__ import annotations

from .ray.proxy import proxy_middlewares

__all__ = ["proxy_middlewares"]
