"""What an API process serves from: stand-ins for the model process's engine, registry, pipeline and
service, with the interfaces the routes already use (server/http/deps.py, routers/, oip/), so the routes,
the guard and the error bodies are the single-process server's own code.

- ``ModelLink``: the link to the model process (link.py), replaced when it restarts; a call while it
  is down is a 503 with ``Retry-After`` (``LinkDownError``). ``EngineInfo``: what the routes read of
  the engine (labels, input shape, preprocessing), sent once; an API process holds no weights.
- ``RemoteRegistry``: a replica of the catalog that follows the store's journal (polled every
  ``MEMVIT_STORE_POLL_SECONDS``, and refreshed for a name not found, exactly as another replica's
  would be), for checking tasks, listing and describing; changes are parsed and checked against the
  caller's key here, then made by the model process, after which this replica refreshes at once.
  Each journal entry is applied whole (registry/catalog.py): seen by every process within a poll.
- ``RemoteRunner``: the request side's ``Runner`` (server/inference/runner.py) across the link: the model
  process's runner starts (pinning the adapters and announcing the images to its engine loop) while
  this process decodes, then the decoded images follow through shared memory (``wire.py``); the
  request's ``Answer`` comes back (its arrays, its labels by key: labels.py), and the response is
  built here by the same request side as in one process.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from memvit.adapters import AdapterBundle, read_bundle

from ..inference.answers import Answer
from ..inference.runner import Ask, Images
from ..registry import RegistryInfo
from ..registry.catalog import Catalog
from ..registry.reads import CatalogReads
from ..store import AdapterStore, Entry
from ..store.base import legacy_name
from ..tenancy.usage_log import UsageLog
from .labels import LabelCache
from .link import LinkDownError
from .link_client import LinkClient
from .shm_arena import Arena
from .wire import pack


class ModelLink:
    """The current link to the model process (None while it is down)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.client: LinkClient | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.registry: RemoteRegistry | None = None  # refreshed when the model process says it changed
        self._refreshing: set[asyncio.Task] = set()

    async def connect(self) -> None:
        client = LinkClient(self.path, on_notice=self._notice)
        await client.connect()
        self.client, self.loop = client, asyncio.get_running_loop()

    def _notice(self, method: str, *args: Any) -> None:
        """``changed``: another process changed the registry; its change is acknowledged once every
        API process has read the journal (``refreshed``), so a client's next request sees it here too."""
        if method != "changed":
            return
        (token,) = args

        async def refresh() -> None:
            try:
                if self.registry is not None:
                    await asyncio.to_thread(self.registry.sync)
            finally:
                self.call_soon("refreshed", token)

        task = asyncio.ensure_future(refresh())
        self._refreshing.add(task)
        task.add_done_callback(self._refreshing.discard)

    async def wait_closed(self) -> None:
        if self.client is not None:
            await self.client.wait_closed()
            self.client = None

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        client = self.client
        if client is None or not client.connected:
            raise LinkDownError("the model process is not reachable; retry shortly")
        return await client.call(method, *args, **kwargs)

    def send(self, method: str, *args: Any) -> tuple[asyncio.Future, list]:
        """A call leaving with this loop turn's frames; its answer, and its message (``amend``)."""
        client = self.client
        if client is None or not client.connected:
            raise LinkDownError("the model process is not reachable; retry shortly")
        return client.open_call(method, *args)

    def call_soon(self, method: str, *args: Any) -> None:
        """A call nobody waits for (a delivery, a release); dropped while the link is down."""
        client = self.client
        if client is not None and client.connected:
            client.notify(method, *args)

    def call_sync(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """From a worker thread (never the event loop's): the call, run on the event loop."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if self.loop is None or running is self.loop:  # on the event loop it would wait for itself
            raise LinkDownError("the model process is not reachable; retry shortly")
        return asyncio.run_coroutine_threadsafe(self.call(method, *args, **kwargs), self.loop).result()

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()


def _retrieve(future: asyncio.Future) -> None:  # a failure nobody waits for is not one to log
    if not future.cancelled():
        future.exception()


class EngineInfo:
    """The engine as the routes see it (labels, input shape, preprocessing), without its weights."""

    def __init__(self, info: dict[str, Any]) -> None:
        self.labels: tuple[str, ...] | None = info["labels"]
        self.spec = info["spec"]
        self.source, self.dtype = info["source"], info["dtype"]
        self.device = torch.device(info["device"])  # where the model runs (and JPEGs may decode)
        self._data_config = dict(info["data_config"])
        proj = SimpleNamespace(in_channels=info["in_chans"])
        self.base = SimpleNamespace(num_classes=info["num_classes"], patch_embed=SimpleNamespace(proj=proj))

    def data_config(self) -> dict[str, Any]:
        return dict(self._data_config)


def _no_migration(name: str, key: str, data: bytes) -> Entry:
    raise RuntimeError("an API process never migrates the store; the model process opened it first")


class RemoteRegistry(CatalogReads):
    """The registry as the routes see it (``AdapterRegistry``'s reading side, and its changes)."""

    def __init__(
        self,
        link: ModelLink,
        engine: EngineInfo,
        store: AdapterStore,
        *,
        max_bundle_bytes: int,
        max_tasks: int,
    ) -> None:
        self.link, self.engine, self.store = link, engine, store
        self.max_bundle_bytes, self.max_tasks = max_bundle_bytes, max_tasks
        self.catalog = Catalog(store)
        self._counts: dict[int, int] = {}  # versions answers were computed at -> adapters then

    def open(self) -> None:
        self.catalog.open(_no_migration, max_bytes=self.max_bundle_bytes)

    def sync(self) -> bool:
        return bool(self.catalog.refresh())

    def remember(self, info: RegistryInfo) -> None:
        self._counts[info.version] = info.adapters
        while len(self._counts) > 256:
            del self._counts[next(iter(self._counts))]

    def training(self, name: str) -> dict[str, Any] | None:
        return self.link.call_sync("training", name)

    @property
    def invalid(self) -> dict[str, str]:
        """The model process's list (it knows the bundles that failed to load), or the catalog's."""
        try:
            return self.link.call_sync("invalid")
        except LinkDownError:
            return {legacy_name(key) or key: why for key, why in self.catalog.invalid.items()}

    def lookup_refresh(self) -> None:
        self.catalog.refresh_for_lookup()

    def register(
        self, data: bytes, *, replace: bool = False, authorize: Callable[[AdapterBundle], None] | None = None
    ) -> tuple[Entry, RegistryInfo, bool]:
        """Parsed and checked against the caller's key here (422, 403 before anything is sent), then
        checked against the engine and the registry, written and journaled by the model process,
        which takes the parsed bundle with the bytes (one parse per registration: the tensors
        pickle at their size, a small part of the bytes'); this replica then reads the change."""
        bundle = read_bundle(data, max_bytes=self.max_bundle_bytes)
        if authorize is not None:
            authorize(bundle)
        answer = self.link.call_sync("register", data, replace, bundle)
        self.catalog.refresh()
        return answer

    def delete(self, name: str) -> RegistryInfo:
        info = self.link.call_sync("delete", name)
        self.catalog.refresh()
        return info


def answer_to_wire(answer: Answer, keys: Any) -> tuple:
    """An answer as the model process sends it: its arrays as raw bytes (a numpy array pickles at ten
    times a bytes object's cost), each task's labels by key (``keys``: ``LabelKeys.cached()``)."""
    probs, logits = answer.probs, answer.logits
    shape = (*probs.shape, 0 if logits is None else logits.shape[2])
    return (answer.tasks, shape, answer.classes.tobytes(), probs.tobytes(), answer.index.tobytes(),
            None if logits is None else logits.tobytes(), keys.keys(answer.labels), answer.version,
            answer.registered, tuple(answer.stages.items()))  # fmt: skip


def answer_from_wire(wire: tuple, labels: tuple) -> Answer:
    tasks, (n, T, k, C), classes, probs, index, logits, _, version, registered, stages = wire
    return Answer(
        tasks,
        np.frombuffer(classes, dtype=np.int64),
        np.frombuffer(probs, dtype=np.float32).reshape(n, T, k),
        np.frombuffer(index, dtype=np.int64).reshape(n, T, k),
        None if logits is None else np.frombuffer(logits, dtype=np.float32).reshape(n, T, C),
        labels,
        version,
        registered,
        dict(stages),
    )


class RemoteRunner:
    """``Runner`` across the link: the model process's ``LocalRunner``'s work is done there (pin,
    announce, batch, count), this process decodes meanwhile, and the images follow through shared
    memory (``wire.py``). What comes back is the request's ``Answer``, labels by key (labels.py)."""

    def __init__(
        self, link: ModelLink, arena: Arena | None, registry: RemoteRegistry, labels: LabelCache
    ) -> None:
        self.link, self.arena, self.registry, self.labels = link, arena, registry, labels
        self._numbers = itertools.count()

    async def run(self, ask: Ask, images: Awaitable[Images]) -> Answer:
        """The model process starts first (pins the adapters, announces the images), then waits for
        the images this process decodes meanwhile."""
        number = next(self._numbers)
        tenant = ask.tenant
        try:  # the frame leaves with this turn's others; no task per request
            call, message = self.link.send("run", number, ask.count, ask.tasks, tenant.id, tenant.weight,
                                           ask.top_k, ask.logits)  # fmt: skip
        except LinkDownError as exc:  # raised when awaited: after the images, as a call's would be
            call, message = asyncio.get_running_loop().create_future(), None
            call.set_exception(exc)
        tickets: list = []

        def free(_: asyncio.Future | None = None) -> None:  # once the model process has answered
            if self.arena is not None:
                for ticket in tickets:
                    self.arena.free(ticket)
            tickets.clear()

        call.add_done_callback(_retrieve)
        call.add_done_callback(free)
        delivered = False
        try:
            decoded = await images
            payload, tickets[:] = pack(decoded, self.arena)
            if call.done():
                free()
            # checked in the same turn (the device path's JPEGs): in "run"'s frame; else a "deliver"
            if message is None or not LinkClient.amend(message, payload):
                self.link.call_soon("deliver", number, payload)
            delivered = True
            wire = await asyncio.shield(call)
        finally:
            if not delivered:  # a bad image, or the client went away: the model process stops waiting
                self.link.call_soon("deliver", number, None)
        tasks, keys, version, registered = wire[0], wire[6], wire[7], wire[8]
        self.registry.remember(RegistryInfo(version, registered))
        return answer_from_wire(wire, await self.labels.resolve(tasks, keys))


class ResidentCount:
    """``live.current`` as /readyz reads it: only its size, as the model process last said."""

    def __init__(self) -> None:
        self.current: list[None] = []

    def set(self, n: int) -> None:
        self.current = [None] * n


@dataclass(frozen=True)
class RemoteUsage:
    log: UsageLog | None  # read by GET /usage; the model process writes it

    def flush(self) -> None:
        pass
