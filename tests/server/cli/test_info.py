"""``memvit info``, and what every command does first (server/cli/__init__.py, info.py)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from memvit.server.cli import app

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


def test_every_command_pins_malloc_before_running(monkeypatch) -> None:
    # The server's fused passes lose ~20% at batch 32 with glibc's default mmap threshold: every
    # command (serve, train, eval included) must pin it, as the benchmarks' raw passes do.
    import memvit.memory_core.runtime

    calls = []
    monkeypatch.setattr(memvit.memory_core.runtime, "tune_malloc", lambda: calls.append(1) or True)
    result = runner.invoke(app, ["info", "deit_tiny_patch16_224"])
    assert result.exit_code == 0, result.output
    assert calls == [1]
