"""Service settings, read once from the environment (prefix ``MEMVIT_``) or a ``.env`` file.

With nothing set, the service serves the embedded demo (``server/demo/``) on 127.0.0.1:8000 with an
adapter store in ``./adapter-store``.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

# The engine's process on a GPU, chosen by the GPU suite's server step (benchmarks/RESULTS.md §3.16,
# an H200, DeiT-Tiny float32, 8 API processes, 64 clients, every answer right): each alone against the
# front end without it, 2 decode threads 2,305 img/s and a 0.5 ms switch interval 2,628, against
# 1,991-2,145 for one thread and Python's 5 ms.
GPU_DECODE_THREADS = 2
GPU_GIL_SWITCH_MS = 0.5


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MEMVIT_", env_file=".env", extra="ignore")

    # The base model. Neither set: the embedded demo. `weights` alone: a self-describing safetensors
    # file (metadata names the architecture); `model` alone: random weights (for tests only).
    model: str | None = Field(None, description="timm architecture of the base model")
    weights: Path | None = Field(None, description="local .safetensors/.pth weights of the base")
    labels_file: Path | None = Field(None, description="one class name per line, for the base task")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # Off by default: the mode costs throughput (benchmarks/RESULTS.md §1) and most users never see the
    # last-bit differences it removes (memory_core/invariant/).
    batch_invariant: bool = Field(
        False, description="bit-identical logits per image, whatever shares its batch or is loaded"
    )

    # The GPU engine (docs/design.md §2.10): passes replayed as CUDA graphs, and the class-token
    # attention and heads as Triton kernels ("auto": Triton on CUDA, torch elsewhere).
    cuda_graphs: bool = Field(True, description="on CUDA, replay each pass as a graph captured per shape")
    # No batch waits for a CUDA graph's capture (server/inference/warmup.py): a shape first met runs
    # eagerly while a thread captures it, and when an install grows the slot pools their graphs are
    # captured on the installing thread while the loop serves from the old ones. False: as before,
    # a first shape is captured by its batch, and a growth's graphs by the batcher with the loop idle.
    graphs_beside_serving: bool = Field(True, description="capture CUDA graphs beside serving")
    kernels: Literal["auto", "torch", "triton"] = Field(
        "auto", description="class-token attention and heads: Triton (CUDA) or torch"
    )

    adapter_store: str = Field(
        "adapter-store",
        description="a directory, or an object-store URL (s3://bucket/prefix, gs://..., az://...)",
    )
    store_poll_seconds: float = Field(2.0, gt=0, description="how often to look for other replicas' changes")
    # Registered is not resident: the store may hold any number of adapters; this many (and at most
    # this many bytes, if set) are prepared in memory, the least recently used evicted (design §5).
    resident_adapters: int = Field(1024, ge=1, description="adapters prepared in memory at most")
    resident_bytes: int | None = Field(None, ge=1, description="bytes of resident adapters at most")
    max_tasks_per_request: int = Field(
        64, ge=1, description="adapters one request may ask for; with no ?tasks=, the registry's size cap"
    )

    max_batch: int = Field(32, ge=1, description="images per fused pass")
    max_wait_ms: float = Field(5.0, ge=0, description="how long a batch waits for more requests")
    # A batch whose queue is empty waits this many mean gaps between requests for the next one (within
    # max_wait; off by default: it costs a client sending one request after another up to two gaps
    # each, RESULTS §3.14); 0: only for those announced (inference/arrivals.py).
    batch_linger: float = Field(0.0, ge=0, description="mean arrival gaps a batch waits for the next request")
    max_queue: int = Field(256, ge=1, description="images waiting before requests get 503")
    # None: one per core this process may run on (Pillow releases the GIL while it decodes and resizes).
    decode_workers: int | None = Field(None, ge=1, description="threads decoding images (default: cores)")
    decode: Literal["exact", "fast"] = Field(
        "exact", description="exact: every pixel; fast: large JPEGs shrunk in the decoder (RESULTS)"
    )
    # JPEGs decoded on the model's device in each batch (server/inference/device_decode.py): "auto" does it
    # when the model is on a GPU and decode is "exact"; "device" also on a CPU model (torchvision's CPU
    # decoder: the device path's own code, as CI tests it); "cpu" never.
    decode_device: Literal["auto", "device", "cpu"] = Field(
        "auto", description="decode JPEGs on the model's device: auto (on a GPU), device, or cpu"
    )
    # On a GPU, the threads that form batches and put their images on the device, each with a decoder
    # and a stream of its own (server/inference/engine_loop.py): torchvision's GPU decoder is one object
    # behind a lock, so a second thread overlaps the rest of a batch's decode stage (the checks, the
    # preprocessing, the GIL) with the other's decoder call. None: GPU_DECODE_THREADS; 1 on a CPU
    # whatever this says.
    device_decode_threads: int | None = Field(
        None, ge=1, le=4, description="GPU decode threads, each with its own stream (default 2)"
    )
    # Each device decoder call padded with a tiny JPEG up to the first of these sizes that holds it
    # (server/inference/device_decode.py), so the decoder sees a few call sizes, not every batch's
    # own; empty: calls as they come. Off until the GPU suite's `at mixed sizes` rows say it pays.
    device_decode_call_sizes: Annotated[list[int], NoDecode] = Field(
        default_factory=list, description="comma-separated decoder call sizes to pad to (e.g. 16,32,64)"
    )
    # A Server-Timing header on /classify and OIP answers: the request's stages in milliseconds.
    server_timing: bool = Field(False, description="say each answer's stage times in a Server-Timing header")
    max_images_per_request: int = Field(16, ge=1)
    # The interpreter's GIL switch interval in the process that runs the engine (sys.setswitchinterval):
    # each tensor operation of the engine's stages releases the GIL and takes it back, and beside a
    # thread running Python it may wait up to the interval (5 ms, Python's default) to get it.
    # None: GPU_GIL_SWITCH_MS when the engine is on a GPU, Python's on a CPU (on the 2-core build
    # machine a shorter one made no difference, RESULTS §3.15).
    gil_switch_ms: float | None = Field(
        None, gt=0, le=100, description="GIL switch interval of the engine process, ms (0.5 on a GPU)"
    )
    # How the engine's process waits for the GPU (memory_core/runtime.py ``cuda_host_waits``): "auto"
    # is CUDA's default (spinning while cores outnumber contexts), "block" sleeps until woken.
    cuda_waits: Literal["auto", "spin", "yield", "block"] = Field(
        "auto", description="how the engine's process waits for the GPU: auto, spin, yield or block"
    )
    # Images are decoded and fused passes filled by the service each key has received, by its weight
    # (server/inference/fair_queue.py); false: by arrival, as before keys had shares.
    fair_batching: bool = Field(True, description="share passes and decoders between keys by weight")

    max_image_bytes: int = Field(20 * 1024 * 1024, ge=1, description="upload cap per image")
    max_image_pixels: int = Field(40_000_000, ge=1, description="decompression-bomb guard")
    max_bundle_bytes: int = Field(64 * 1024 * 1024, ge=1, description="upload cap per adapter bundle")
    admin_token: SecretStr | None = Field(None, description="Bearer token for POST/DELETE /adapters")
    # Safe by default: with no token, POST/DELETE /adapters answer 403 unless this opts out.
    allow_anonymous_admin: bool = Field(
        False, description="with no admin token, let anyone who can reach the port manage adapters"
    )

    # Tenant keys (server/tenancy/keys.py, `memvit keys`): a JSON file of hashed keys, each covering adapters.
    api_keys_file: Path | None = Field(None, description="tenant API keys (memvit keys add/list/revoke)")
    api_keys_reload_seconds: float = Field(2.0, gt=0, description="how often the keys file is checked")
    require_read_key: bool = Field(
        False, description="/classify and GET /adapters need a key (or the admin token); a key reads its own"
    )
    # Host names this server may be reached by, beyond its bind address, localhost and IP literals
    # (server/edge/origin.py): checked on a loopback bind, or on any bind once this is set.
    allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="comma-separated host names (a proxy's, a cluster's; *.example.com)"
    )

    # Slow clients (headers: server/http/timeouts.py; body: server/edge/body.py): past these, the client gets
    # a 408 and its connection closes.
    header_timeout_seconds: float = Field(10.0, gt=0, description="deadline for a request's headers")
    body_timeout_seconds: float = Field(60.0, gt=0, description="total deadline for a request's body")

    # Usage per key (server/tenancy/usage.py): written beside the adapters, a record per replica and interval.
    usage_log: bool = Field(True, description="write usage per key and task to the adapter store")
    usage_interval_seconds: float = Field(
        60.0, gt=0, description="how often usage is written (a crash loses at most this much)"
    )
    replica_name: str | None = Field(None, description="this replica's name in the usage log (default: host)")
    # Per-task Prometheus series (server/telemetry/task_labels.py): base, these, the N most asked, "other".
    metrics_tasks: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="comma-separated adapter names that always get their own series"
    )
    metrics_top_tasks: int = Field(20, ge=0, description="the N most asked adapters get their own series")

    # Several processes on one port (server/frontend/, docs/design.md §5): 1 is the single-process
    # server. "model-process": N API processes (HTTP, guard, keys, decoding) feeding one model process
    # (engine, registry, batcher) through shared memory; "replicas": N full servers, each its own
    # engine and batcher. None: model-process. Unset on a GPU host, `memvit serve` makes it
    # min(8, cores // 2) API processes and one model process (server/cli/serve.py, gpu_host_default).
    api_processes: int = Field(1, ge=1, le=64, description="processes answering HTTP on the one port")
    front_end: Literal["model-process", "replicas"] | None = Field(
        None, description="with several API processes: one model process behind them, or N replicas"
    )

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @model_validator(mode="after")
    def _resident_holds_a_request(self) -> Settings:
        if self.resident_adapters < self.max_tasks_per_request:
            raise ValueError(
                f"MEMVIT_RESIDENT_ADAPTERS ({self.resident_adapters}) must be at least "
                f"MEMVIT_MAX_TASKS_PER_REQUEST ({self.max_tasks_per_request}): a request's adapters "
                "must fit in memory at once"
            )
        return self

    @field_validator("model", "weights", "labels_file", "api_keys_file", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        # `MEMVIT_WEIGHTS=` (as docker compose passes an unset variable) means "not configured",
        # not the current directory.
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        if isinstance(value, str):
            value = value.split(",")
        if isinstance(value, (list, tuple)):
            return [str(v).strip().lower().rstrip(".") for v in value if str(v).strip()]
        return value

    @field_validator("device_decode_call_sizes", mode="before")
    @classmethod
    def _call_sizes(cls, value: object) -> object:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        return value

    @field_validator("device_decode_call_sizes")
    @classmethod
    def _ascending_sizes(cls, value: list[int]) -> list[int]:
        if value != sorted(set(value)) or any(size < 1 for size in value):
            raise ValueError(f"decoder call sizes must be positive and ascending (16,32,64), not {value}")
        return value

    @field_validator("metrics_tasks", mode="before")
    @classmethod
    def _task_list(cls, value: object) -> object:
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        return value

    @field_validator("adapter_store", mode="before")
    @classmethod
    def _store_as_text(cls, value: object) -> object:
        if isinstance(value, Path):
            return str(value)
        return "adapter-store" if isinstance(value, str) and not value.strip() else value

    @field_validator("admin_token")
    @classmethod
    def _empty_token_is_none(cls, value: SecretStr | None) -> SecretStr | None:
        return value if value is None or value.get_secret_value() else None

    @property
    def decode_threads(self) -> int:
        """``decode_workers``, or one per core this process may run on (its CPU affinity, so a
        container limited by cpuset gets its own count, not the host's)."""
        if self.decode_workers is not None:
            return self.decode_workers
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except AttributeError:  # not on Linux
            return max(1, os.cpu_count() or 1)

    def engine_decode_threads(self, device_type: str) -> int:
        """``device_decode_threads``, or GPU_DECODE_THREADS when the engine is on a GPU and 1 elsewhere
        (where the engine loop runs one decode thread whatever this says)."""
        if self.device_decode_threads is not None:
            return self.device_decode_threads
        return GPU_DECODE_THREADS if device_type == "cuda" else 1

    def engine_gil_switch_ms(self, device_type: str) -> float | None:
        """``gil_switch_ms``, or GPU_GIL_SWITCH_MS when the engine is on a GPU; None: Python's own."""
        if self.gil_switch_ms is not None:
            return self.gil_switch_ms
        return GPU_GIL_SWITCH_MS if device_type == "cuda" else None

    @property
    def access_log(self) -> bool:
        """uvicorn's line per request, logged at info: off above it, where it would be built per
        request (client address, path and query) only to be dropped."""
        return self.log_level in ("debug", "info")

    @property
    def front_end_mode(self) -> Literal["single", "model-process", "replicas"]:
        """How ``memvit serve`` runs: one process, or which front end of several."""
        if self.api_processes == 1:
            return "single"
        return self.front_end or "model-process"

    @property
    def anonymous_admin(self) -> bool:
        """Anyone may manage adapters: opted into, and neither a token nor a keys file configured."""
        return self.allow_anonymous_admin and self.admin_token is None and self.api_keys_file is None

    @property
    def uses_demo(self) -> bool:
        return self.model is None and self.weights is None


@lru_cache
def get_settings() -> Settings:
    return Settings()
