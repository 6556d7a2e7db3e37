"""``memvit inspect`` (server/cli/inspect.py)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from memvit.adapters import bundle_for, save_bundle
from memvit.server.cli import app
from tests.conftest import random_adapter

runner = CliRunner()


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
