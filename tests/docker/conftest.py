"""The manifests rendered once for every test of this package that reads them."""

from __future__ import annotations

import pytest
import yaml

from .k8s_render import TARGETS, _example_secrets, _kustomize, _tree


@pytest.fixture(scope="package")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """Every target rendered, with every key of the Secret's template filled in."""
    secrets = {key: f"test-{key.lower()}" for key in _example_secrets()}
    tree = _tree(tmp_path_factory.mktemp("k8s"), secrets)
    out = {}
    for target in TARGETS:
        result = _kustomize(tree, target)
        assert result.returncode == 0, f"kubectl kustomize {target} failed:\n{result.stderr}"
        out[target] = [obj for obj in yaml.safe_load_all(result.stdout) if obj is not None]
    return out
