"""``memvit serve``: the HTTP API, settings from MEMVIT_* variables (with none, the embedded demo).

On SIGTERM uvicorn stops accepting, lets running requests finish for up to
``timeout_graceful_shutdown`` seconds (a queued batch included), then the app closes the batcher.
With ``MEMVIT_API_PROCESSES`` > 1 a supervisor runs the processes of a front end instead
(server/frontend/supervisor.py) and stops them all on SIGTERM. On a GPU host, unless
``MEMVIT_API_PROCESSES`` is set, that is the default (``gpu_host_default``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from .common import fail

if TYPE_CHECKING:
    from ..settings import Settings


def serve(
    host: Annotated[str | None, typer.Option(help="bind address (MEMVIT_HOST)")] = None,
    port: Annotated[int | None, typer.Option(help="port (MEMVIT_PORT)")] = None,
    model: Annotated[str | None, typer.Option(help="timm architecture (MEMVIT_MODEL)")] = None,
    weights: Annotated[Path | None, typer.Option(help="base weights (MEMVIT_WEIGHTS)")] = None,
    adapter_store: Annotated[
        str | None,
        typer.Option(help="adapter directory or s3://bucket/prefix (MEMVIT_ADAPTER_STORE)"),
    ] = None,
) -> None:
    """Serve the HTTP API. Settings come from MEMVIT_* variables; with none, the embedded demo."""
    import uvicorn
    from pydantic import ValidationError

    from ..http.app import create_app, preflight
    from ..http.timeouts import header_timeout_protocol
    from ..settings import Settings

    overrides = {
        "host": host,
        "port": port,
        "model": model,
        "weights": weights,
        "adapter_store": adapter_store,
    }
    try:
        settings = Settings(**{k: v for k, v in overrides.items() if v is not None})
        preflight(settings)
    except ValidationError as exc:
        problems = "; ".join(
            f"MEMVIT_{'_'.join(map(str, e['loc'])).upper()}: {e['msg']}" for e in exc.errors()
        )
        raise fail(ValueError(f"invalid settings: {problems}")) from None
    except (ValueError, OSError) as exc:
        raise fail(exc) from None
    logging.getLogger().setLevel(settings.log_level.upper())
    settings = gpu_host_default(loopback_admin_default(settings))
    if settings.front_end_mode != "single":
        from ..frontend.supervisor import serve_group

        logging.basicConfig(format="%(levelname)s:%(name)s: %(message)s")
        raise typer.Exit(serve_group(settings))
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=settings.access_log,
        timeout_graceful_shutdown=10,
        http=header_timeout_protocol(settings.header_timeout_seconds),
    )


# API processes before one model process on a GPU host, at most (and half the cores): the H200 run
# (16 cores, DeiT-Tiny, 64 clients, JPEGs decoded on the GPU) answered 2,000 img/s so, 1,560 with 8
# replicas and 680 with one process, whose one GIL held its engine's stages behind its event loop
# (benchmarks/RESULTS.md §3.15; docs/design.md §5, *Which, and why*).
GPU_HOST_API_PROCESSES = 8


def gpu_host_default(
    settings: Settings, cuda: Callable[[], bool] | None = None, cores: int | None = None
) -> Settings:
    """On a GPU host, unless ``MEMVIT_API_PROCESSES`` is set: the model-process front end with
    ``min(8, cores // 2)`` API processes (at least 2; ``cores``: ``usable_cores()``), said in one
    line. One process stays the default on a CPU (its figures there: RESULTS §3.13-3.14). ``cuda``:
    whether the model's device is a GPU when ``MEMVIT_DEVICE`` is ``auto`` (asked without creating a
    CUDA context)."""
    if "api_processes" in settings.model_fields_set or settings.device == "cpu":
        return settings
    if settings.device == "auto" and not (cuda or _cuda_available)():
        return settings
    n = max(2, min(GPU_HOST_API_PROCESSES, (cores or usable_cores()) // 2))
    logging.getLogger("memvit.server").warning(
        "a GPU host: %d API processes and one model process (MEMVIT_API_PROCESSES=1 for one process)", n
    )
    return settings.model_copy(update={"api_processes": n})


def usable_cores(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """The cores this process may run on: its affinity, capped by its container's CPU quota (cgroup v2
    ``cpu.max``, or v1's ``cpu.cfs_quota_us``; a pod limited to 4 CPUs on a 96-core node has 4)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota = (cgroup / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (cgroup / "cpu" / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return max(1, cores)
    if quota in ("max", "-1") or int(period) <= 0:
        return max(1, cores)
    return max(1, min(cores, int(quota) // int(period)))


def _cuda_available() -> bool:
    """Whether a GPU is there, from NVML where it can say (no CUDA context in the supervisor)."""
    import torch

    before = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    try:
        return torch.cuda.is_available()
    finally:
        if before is None:
            del os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"]
        else:
            os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = before


def loopback_admin_default(settings: Settings) -> Settings:
    """``memvit serve`` on a loopback address with no admin token and no keys file leaves adapter
    management open to local clients (the laptop demo stays one command), saying so in one line; other
    web pages are still refused (server/edge/origin.py). Never for any other address (the image binds
    0.0.0.0), and never over an explicit MEMVIT_ALLOW_ANONYMOUS_ADMIN."""
    from ..edge.origin import is_loopback

    configured = settings.admin_token is not None or settings.api_keys_file is not None
    if configured or "allow_anonymous_admin" in settings.model_fields_set:
        return settings
    if not is_loopback(settings.host):  # a host name other than localhost may resolve to anything
        return settings
    logging.getLogger("memvit.server").warning(
        "no MEMVIT_ADMIN_TOKEN and bound to loopback %s: POST/DELETE /adapters are open to local clients "
        "(not to web pages of other sites; set MEMVIT_ADMIN_TOKEN or MEMVIT_API_KEYS_FILE, or "
        "MEMVIT_ALLOW_ANONYMOUS_ADMIN=false, to close them)",
        settings.host,
    )
    return settings.model_copy(update={"allow_anonymous_admin": True})
