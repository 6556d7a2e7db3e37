"""The model process's control path: what an API process asks on the event loop, not per image.

The engine's description (``info``), registrations and deletions (acknowledged only once every other
API process has read the change), an adapter's training record, the invalid bundles, the resident
count and labels by key. ``ModelHandlers`` (model_process.py) adds the data path (``run``,
``deliver``) and the state these read.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any

from memvit.adapters import AdapterBundle

from ..http.service import update_gauges
from ..http.state import AppState, Service
from .labels import LabelKeys
from .link import LinkServer, current_peer

log = logging.getLogger("memvit.server.model")
REFRESH_SECONDS = 2.0  # a change waits at most this for the other API processes to read it


class ControlCalls:
    """The control path's calls; the attributes are ``ModelHandlers.__init__``'s."""

    state: AppState
    service: Service
    keys: LabelKeys
    server: LinkServer | None
    _tokens: itertools.count
    _refreshes: dict[int, tuple[set[int], asyncio.Event]]

    async def info(self) -> dict[str, Any]:
        engine = self.service.engine
        return {
            "labels": engine.labels,
            "spec": engine.spec,
            "source": engine.source,
            "device": str(engine.device),
            "dtype": str(engine.dtype).removeprefix("torch."),
            "data_config": engine.data_config(),
            "in_chans": engine.base.patch_embed.proj.in_channels,
            "num_classes": int(engine.base.num_classes),
            "max_tasks": self.service.registry.max_tasks,
        }

    async def register(self, data: bytes, replace: bool, parsed: AdapterBundle | None = None) -> Any:
        """``parsed``: the bundle as the API process read it (it parsed it to authorize it)."""
        register = self.service.registry.register
        answer = await asyncio.to_thread(register, data, replace=replace, parsed=parsed)
        await self._every_process_read_it()
        return answer

    async def delete(self, name: str) -> Any:
        answer = await asyncio.to_thread(self.service.registry.delete, name)
        await self._every_process_read_it()
        return answer

    async def _every_process_read_it(self) -> None:
        """Before a change is acknowledged: every other API process has read the journal (it is told
        ``changed`` and says ``refreshed``), so whichever process a client's next request reaches
        sees the change (the one that made it reads the journal itself). At most ``REFRESH_SECONDS``:
        a process that does not answer catches up at its next poll."""
        token = next(self._tokens)
        waiting = self._refreshes[token] = (set(), asyncio.Event())
        try:
            peers = self.server.broadcast("changed", token, skip=current_peer.get())
            waiting[0].update(peers)
            if peers:
                await asyncio.wait_for(waiting[1].wait(), REFRESH_SECONDS)
        except TimeoutError:
            log.warning("an API process did not read a registry change within %.0f s", REFRESH_SECONDS)
        finally:
            del self._refreshes[token]

    async def refreshed(self, token: int) -> None:
        waiting = self._refreshes.get(token)
        if waiting is not None:
            waiting[0].discard(current_peer.get())
            if not waiting[0]:
                waiting[1].set()

    async def training(self, name: str) -> dict[str, Any] | None:
        return await asyncio.to_thread(self.service.registry.training, name)

    async def invalid(self) -> dict[str, str]:
        return self.service.registry.invalid

    async def resident(self) -> int:
        update_gauges(self.service, self.state.metrics)
        return len(self.service.live.current)

    async def labels(self, keys: list[bytes]) -> dict[bytes, tuple[str, ...]]:
        return self.keys.labels(keys)
