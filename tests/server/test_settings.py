"""Settings read from the environment: empty values, the demo default, validation."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from memvit.server.settings import Settings


def test_nothing_set_means_the_demo(monkeypatch) -> None:
    for name in ("MEMVIT_MODEL", "MEMVIT_WEIGHTS", "MEMVIT_LABELS_FILE"):
        monkeypatch.delenv(name, raising=False)
    assert Settings(_env_file=None).uses_demo


def test_empty_variables_are_unset_not_the_current_directory(monkeypatch) -> None:
    # docker compose passes `MEMVIT_WEIGHTS=` when the user did not set it.
    monkeypatch.setenv("MEMVIT_WEIGHTS", "")
    monkeypatch.setenv("MEMVIT_MODEL", " ")
    monkeypatch.setenv("MEMVIT_LABELS_FILE", "")
    monkeypatch.setenv("MEMVIT_ADMIN_TOKEN", "")
    settings = Settings(_env_file=None)
    assert settings.weights is None and settings.model is None and settings.labels_file is None
    assert settings.admin_token is None
    assert settings.uses_demo


def test_values_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("MEMVIT_WEIGHTS", "/models/base.safetensors")
    monkeypatch.setenv("MEMVIT_MAX_BATCH", "8")
    monkeypatch.setenv("MEMVIT_ADMIN_TOKEN", "s3cret")
    settings = Settings(_env_file=None)
    assert settings.weights == Path("/models/base.safetensors") and not settings.uses_demo
    assert settings.max_batch == 8
    assert settings.admin_token.get_secret_value() == "s3cret"
    assert "s3cret" not in repr(settings)


@pytest.mark.parametrize(
    ("name", "value"),
    [("MEMVIT_MAX_BATCH", "0"), ("MEMVIT_DEVICE", "tpu"), ("MEMVIT_PORT", "70000")],
)
def test_bad_values_are_rejected(monkeypatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError, match=name.removeprefix("MEMVIT_").lower()):
        Settings(_env_file=None)


def test_settings_choose_the_decode_and_its_threads(monkeypatch) -> None:
    monkeypatch.delenv("MEMVIT_DECODE_WORKERS", raising=False)
    settings = Settings(_env_file=None)
    assert settings.decode == "exact" and settings.decode_threads == len(os.sched_getaffinity(0))
    monkeypatch.setenv("MEMVIT_DECODE", "fast")
    monkeypatch.setenv("MEMVIT_DECODE_WORKERS", "3")
    settings = Settings(_env_file=None)
    assert settings.decode == "fast" and settings.decode_threads == 3
    monkeypatch.setenv("MEMVIT_DECODE", "quick")
    with pytest.raises(ValidationError, match="decode"):
        Settings(_env_file=None)


def test_security_settings_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("MEMVIT_ALLOWED_HOSTS", "Memvit.example, *.corp.example,,localhost.")
    monkeypatch.setenv("MEMVIT_API_KEYS_FILE", "/run/secrets/keys.json")
    monkeypatch.setenv("MEMVIT_API_KEYS_RELOAD_SECONDS", "0.5")
    monkeypatch.setenv("MEMVIT_REQUIRE_READ_KEY", "true")
    settings = Settings(_env_file=None)
    assert settings.allowed_hosts == ["memvit.example", "*.corp.example", "localhost"]
    assert (
        settings.api_keys_file == Path("/run/secrets/keys.json") and settings.api_keys_reload_seconds == 0.5
    )
    assert settings.require_read_key
    # A keys file closes anonymous management, as a token does.
    assert not settings.model_copy(update={"allow_anonymous_admin": True}).anonymous_admin
    monkeypatch.setenv("MEMVIT_ALLOWED_HOSTS", "")
    monkeypatch.setenv("MEMVIT_API_KEYS_FILE", "")
    settings = Settings(_env_file=None)
    assert settings.allowed_hosts == [] and settings.api_keys_file is None


def test_the_resident_set_must_hold_one_request(monkeypatch) -> None:
    settings = Settings(_env_file=None)
    assert (settings.resident_adapters, settings.resident_bytes, settings.max_tasks_per_request) == (
        1024,
        None,
        64,
    )
    monkeypatch.setenv("MEMVIT_RESIDENT_ADAPTERS", "10")
    with pytest.raises(ValidationError, match=r"MEMVIT_RESIDENT_ADAPTERS \(10\) must be at least"):
        Settings(_env_file=None)
    monkeypatch.setenv("MEMVIT_MAX_TASKS_PER_REQUEST", "10")
    assert Settings(_env_file=None).resident_adapters == 10


def test_the_gil_switch_interval_reaches_the_engines_process(monkeypatch, tiny_weights) -> None:
    import sys

    from memvit.server.http.app import build_engine

    before = sys.getswitchinterval()
    try:
        build_engine(Settings(_env_file=None, weights=tiny_weights))
        assert sys.getswitchinterval() == before  # unset: Python's own
        monkeypatch.setenv("MEMVIT_GIL_SWITCH_MS", "0.5")
        build_engine(Settings(_env_file=None, weights=tiny_weights))
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    finally:
        sys.setswitchinterval(before)
    monkeypatch.setenv("MEMVIT_GIL_SWITCH_MS", "0")
    with pytest.raises(ValidationError, match="gil_switch_ms"):
        Settings(_env_file=None)


def test_the_engine_process_defaults_differ_on_a_gpu(monkeypatch) -> None:
    """Unset, a GPU engine's process runs two decode threads and a 0.5 ms GIL switch interval (the
    H200's server rows, RESULTS §3.16); a CPU's one thread and Python's interval; set, either wins."""
    from memvit.server.settings import GPU_DECODE_THREADS, GPU_GIL_SWITCH_MS

    unset = Settings(_env_file=None)
    assert (GPU_DECODE_THREADS, GPU_GIL_SWITCH_MS) == (2, 0.5)
    assert unset.engine_decode_threads("cuda") == 2 and unset.engine_decode_threads("cpu") == 1
    assert unset.engine_gil_switch_ms("cuda") == 0.5 and unset.engine_gil_switch_ms("cpu") is None
    monkeypatch.setenv("MEMVIT_DEVICE_DECODE_THREADS", "1")
    monkeypatch.setenv("MEMVIT_GIL_SWITCH_MS", "5")
    chosen = Settings(_env_file=None)
    assert chosen.engine_decode_threads("cuda") == 1 and chosen.engine_gil_switch_ms("cuda") == 5
    assert chosen.engine_gil_switch_ms("cpu") == 5


def test_the_device_decode_threads_reach_the_engine_loop(monkeypatch, tiny_weights, tmp_path) -> None:
    """``MEMVIT_DEVICE_DECODE_THREADS``: the runner's decode lanes (a decoder each); on a CPU one decode
    thread runs them all (one batch in flight)."""
    from memvit.server.http.service import _load
    from memvit.server.telemetry.metrics import Metrics

    monkeypatch.setenv("MEMVIT_DEVICE_DECODE_THREADS", "2")
    monkeypatch.setenv("MEMVIT_DEVICE_DECODE_CALL_SIZES", "16, 32,64")  # each lane's decoder pads so
    settings = Settings(_env_file=None, weights=tiny_weights, adapter_store=tmp_path / "store",
                        decode_device="device")  # fmt: skip
    _, _, loop = _load(settings, Metrics())
    try:
        first, second = (lane.decoder for lane in loop.runner.lanes)
        assert first is not None and second is not None and first is not second
        assert first.call_sizes == second.call_sizes == (16, 32, 64)
        assert loop.lanes == 1 and loop.depth == 1
    finally:
        loop.stop()
    monkeypatch.setenv("MEMVIT_DEVICE_DECODE_THREADS", "0")
    with pytest.raises(ValidationError, match="device_decode_threads"):
        Settings(_env_file=None)
    monkeypatch.setenv("MEMVIT_DEVICE_DECODE_THREADS", "1")
    for sizes in ("64,16", "0,8", "eight"):
        monkeypatch.setenv("MEMVIT_DEVICE_DECODE_CALL_SIZES", sizes)
        with pytest.raises(ValidationError, match="device_decode_call_sizes"):
            Settings(_env_file=None)
    monkeypatch.setenv("MEMVIT_DEVICE_DECODE_CALL_SIZES", "")
    assert Settings(_env_file=None).device_decode_call_sizes == []  # unset: calls as they come


def test_the_gpu_engine_settings_reach_the_engine(monkeypatch, tiny_weights) -> None:
    from memvit.server.http.app import build_engine, preflight

    monkeypatch.setenv("MEMVIT_CUDA_GRAPHS", "false")
    monkeypatch.setenv("MEMVIT_KERNELS", "torch")
    engine = build_engine(Settings(_env_file=None, weights=tiny_weights))
    assert engine.cuda_graphs is False and engine.kernels == "torch"
    monkeypatch.setenv("MEMVIT_KERNELS", "cuda")
    with pytest.raises(ValidationError, match="kernels"):
        Settings(_env_file=None)
    if torch.cuda.is_available():
        return
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the tests' interpreter does not count
    triton = Settings(_env_file=None, weights=tiny_weights, kernels="triton", device="cpu")
    with pytest.raises(ValueError, match="MEMVIT_KERNELS=triton needs a CUDA device"):
        preflight(triton)


def test_graphs_beside_serving_reaches_the_engine_loop(monkeypatch, tiny_weights, tmp_path) -> None:
    """``MEMVIT_GRAPHS_BESIDE_SERVING``: on (the default), the loop captures graphs beside serving;
    off, in the way. A CPU's passes capture nothing: no hook either way (the GPU's is tested with
    stand-in graphs in tests/server/inference/test_warmup.py)."""
    from memvit.server.http.service import _load
    from memvit.server.telemetry.metrics import Metrics

    for value, hooked in (("true", True), ("false", False)):
        monkeypatch.setenv("MEMVIT_GRAPHS_BESIDE_SERVING", value)
        settings = Settings(_env_file=None, weights=tiny_weights, adapter_store=tmp_path / value)
        _, registry, loop = _load(settings, Metrics())
        try:
            assert loop.graphs.beside is hooked and registry.live.on_growth is None
        finally:
            loop.stop()
        assert registry.live.on_growth is None  # a stopped loop captures nothing


def test_the_cuda_waits_reach_the_engines_process(monkeypatch, tiny_weights) -> None:
    """``MEMVIT_CUDA_WAITS``: set where the engine is built, on its resolved device, before its first
    tensor there (memory_core/runtime.py ``cuda_host_waits``; on a CPU it sets nothing)."""
    from memvit.server.http import service

    seen = []
    monkeypatch.setattr(service, "cuda_host_waits", lambda device, mode: seen.append((device.type, mode)))
    service.build_engine(Settings(_env_file=None, weights=tiny_weights, device="cpu"))
    monkeypatch.setenv("MEMVIT_CUDA_WAITS", "block")
    service.build_engine(Settings(_env_file=None, weights=tiny_weights, device="cpu"))
    assert seen == [("cpu", "auto"), ("cpu", "block")]
    monkeypatch.setenv("MEMVIT_CUDA_WAITS", "busy")
    with pytest.raises(ValidationError, match="cuda_waits"):
        Settings(_env_file=None)
