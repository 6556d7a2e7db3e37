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

from memvit.memory_core import LiveAdapters, MemoryViT

from .batching import DynamicBatcher
from .metrics import Metrics
from .pipeline import ClassifyPipeline
from .registry import AdapterRegistry
from .settings import Settings
from .usage import UsageMeter


@dataclass(frozen=True)
class Service:
    """The loaded model, its live adapter set, its adapter registry and the /classify pipeline."""

    engine: MemoryViT
    live: LiveAdapters  # the resident adapters, served now; ``registry`` decides which they are
    registry: AdapterRegistry
    pipeline: ClassifyPipeline
    batcher: DynamicBatcher
    decode_pool: ThreadPoolExecutor
    usage: UsageMeter  # usage per key, written beside the adapters (its log is None when off)

    async def close(self) -> None:
        await self.batcher.stop()
        self.decode_pool.shutdown(wait=False, cancel_futures=True)
        self.registry.close()


@dataclass
class AppState:
    settings: Settings
    metrics: Metrics
    service: Service | None = None  # set once, when loading has finished
    loader: asyncio.Task | None = None  # loads the model and the store, then sets ``service``
    tasks: list[asyncio.Task] = field(default_factory=list)  # every background task, the loader included
