"""An API process or replica listens on the group's port only once it can answer.

With ``SO_REUSEPORT`` the kernel spreads a port's connections over every socket listening on it,
ready or not: a process still loading (or still connecting to the model process) would be handed
its share and answer them "not ready" while another process stands ready. So the socket is bound at
start (the port is the group's) and listens only when the process says it can answer; until any
process listens, the supervisor answers the port (standin.py).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

import uvicorn

log = logging.getLogger("memvit.server.api")


class Able:
    """Whether this process can answer: set from the app's start-up (any number of times)."""

    def __init__(self) -> None:
        self.event: asyncio.Event | None = None
        self.early = False

    def set(self) -> None:
        if self.event is None:
            self.early = True
        else:
            self.event.set()

    async def wait(self) -> None:
        self.event = asyncio.Event()
        if self.early:
            self.event.set()
        await self.event.wait()


class ListenWhenAble(uvicorn.Server):
    """uvicorn, with the app started at once (its lifespan loads the model, or follows the model
    process) and the port listened on only once ``able`` is set: with ``SO_REUSEPORT`` a process that
    listens is handed its share of the connections, ready or not. ``listening`` is called then (the
    supervisor's ready event)."""

    def __init__(
        self, config: uvicorn.Config, sock: socket.socket, able: Able, listening: Callable[[], None]
    ) -> None:
        super().__init__(config)
        self.sock, self.able, self.listening = sock, able, listening
        self._waiting: asyncio.Task | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=[])  # the lifespan (the app's start-up begins); no listener
        if not self.should_exit:
            self._waiting = asyncio.create_task(self._listen_when_able())

    async def _listen_when_able(self) -> None:
        await self.able.wait()
        config, loop = self.config, asyncio.get_running_loop()

        def protocol(_loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Protocol:
            return config.http_protocol_class(  # as uvicorn's own startup builds it
                config=config, server_state=self.server_state, app_state=self.lifespan.state, _loop=_loop
            )

        try:
            self.servers.append(await loop.create_server(protocol, sock=self.sock, backlog=config.backlog))
        except OSError as exc:  # the supervisor restarts this process
            log.error("cannot listen on port %d: %s", self.sock.getsockname()[1], exc)
            self.should_exit = True
            return
        log.info("listening on port %d", self.sock.getsockname()[1])
        self.listening()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._waiting is not None:
            self._waiting.cancel()
        await super().shutdown(sockets=sockets)


def bound(host: str, port: int) -> socket.socket:
    """This process's socket on the port every API process shares (``SO_REUSEPORT``), bound but not
    listening: the port's group takes it in only at ``listen``."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock
