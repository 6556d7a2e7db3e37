"""The per-app runtime state that request handlers reach through ``deps``."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from memory_core import MemoryViT

from .adapter_service import AdapterService
from .batching import DynamicBatcher
from .images import ImageDecoder
from .metrics import Metrics
from .settings import Settings


@dataclass
class Runtime:
    """Everything a request handler needs; ``ready`` once the model and the store are loaded."""

    settings: Settings
    metrics: Metrics
    decode_pool: ThreadPoolExecutor
    engine: MemoryViT | None = None
    decoder: ImageDecoder | None = None
    batcher: DynamicBatcher | None = None
    adapters: AdapterService | None = None
    ready: bool = False
    tasks: list[asyncio.Task] = field(default_factory=list)
