"""The ``memvit`` console script, run in-process through typer's runner."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from adapters import bundle_for, save_bundle
from server.cli import app
from tests.conftest import random_adapter

runner = CliRunner()


def test_info_prints_shape_and_cost_model() -> None:
    result = runner.invoke(app, ["info", "deit_tiny_patch16_224", "--adapters", "8", "--memory", "5"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["tokens"] == 197 and report["depth"] == 12
    assert abs(report["flop_ratio"]["8"] - 1.041) < 1e-3


def test_info_refuses_a_model_without_class_token() -> None:
    result = runner.invoke(app, ["info", "vit_base_patch16_siglip_224"])
    assert result.exit_code == 2
    assert "has no class token" in result.output


def test_inspect_valid_and_broken_bundles(tmp_path, engine) -> None:
    path = save_bundle(bundle_for(random_adapter("cli", engine, m=2), engine), tmp_path / "cli.safetensors")
    result = runner.invoke(app, ["inspect", str(path)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["memory_tokens"] == 2
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(path.read_bytes()[:-10])
    result = runner.invoke(app, ["inspect", str(broken)])
    assert result.exit_code == 2
    assert "truncated" in result.output
