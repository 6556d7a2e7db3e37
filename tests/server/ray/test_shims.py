"""The import paths deployments named before server/ray/ existed still load the same objects, and
every path the Ray configs under docker/ray/ name resolves."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

pytest.importorskip("ray.serve", reason="the Ray Serve tests need the ray extra (ray[serve])")

REPO = Path(__file__).resolve().parents[3]


def _load(path: str) -> object:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("memvit.server.ray_serve:app", "memvit.server.ray.serve:app"),
        ("memvit.server.ray_router:AdapterAffinityRouter", "memvit.server.ray.router:AdapterAffinityRouter"),
        ("memvit.server.ray_proxy:proxy_middlewares", "memvit.server.ray.proxy:proxy_middlewares"),
    ],
)
def test_old_paths_load_the_same_objects(old: str, new: str) -> None:
    assert _load(old) is _load(new)


def test_every_path_the_configs_name_resolves() -> None:
    named = set()
    for config in (REPO / "docker" / "ray").glob("*.yaml"):
        named |= set(re.findall(r"memvit\.server\.[\w.]+:\w+", config.read_text()))
    assert "memvit.server.ray.serve:app" in named and len(named) >= 3
    for path in sorted(named):
        assert _load(path) is not None, path
