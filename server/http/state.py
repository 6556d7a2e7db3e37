"""What request handlers reach through ``deps``: the app's state, and the service once it is ready.

``AppState`` exists from the moment the app is created (settings, metrics, background tasks).
``Service`` exists only once the model and the adapter store are loaded, and is complete when it
does: handlers that need it get it through a dependency that answers 503 until then, so no handler
ever meets a half-built service.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..settings import Settings
from ..telemetry.metrics import Metrics

if TYPE_CHECKING:
    from ..inference.engine_loop import EngineLoop
    from .pipeline import ClassifyPipeline


@dataclass(frozen=True)
class Service:
    """What the routes serve from (server/http/service.py assembles it). In the process that holds the
    model: the engine, its live adapter set, the registry, the usage meter and the engine loop; in an
    API process, their stand-ins (server/frontend/remote.py) and no engine loop."""

    engine: Any  # MemoryViT, or an API process's EngineInfo
    live: Any  # LiveAdapters: the resident adapters, served now; ``registry`` decides which they are
    registry: Any  # AdapterRegistry, or an API process's RemoteRegistry
    pipeline: ClassifyPipeline
    decode_pool: ThreadPoolExecutor
    usage: Any  # UsageMeter: usage per key, written beside the adapters (its log is None when off)
    engine_loop: EngineLoop | None = None

    async def close(self) -> None:
        if self.engine_loop is not None:
            await asyncio.to_thread(self.engine_loop.stop)
        self.decode_pool.shutdown(wait=False, cancel_futures=True)
        close = getattr(self.registry, "close", None)
        if close is not None:
            close()


@dataclass
class AppState:
    settings: Settings
    metrics: Metrics
    service: Service | None = None  # set once, when loading has finished
    loader: asyncio.Task | None = None  # loads the model and the store, then sets ``service``
    tasks: list[asyncio.Task] = field(default_factory=list)  # every background task, the loader included
