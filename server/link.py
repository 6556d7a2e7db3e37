"""Calls between the API processes and the model process: one Unix socket each, framed messages, any
number of calls in flight, answered in any order.

A frame is a 4-byte length and a pickle: ``(call id, method, args, kwargs)`` one way, ``(call id,
ok, result)`` the other. Both ends are this package's own processes, started together by one
supervisor (server/frontend/), on a socket in a directory only they can reach; large payloads (the
uploads) go through shared memory (server/shm_arena.py) and only their tickets through here. An
error raised by a handler comes back as the same exception class with the same message and field,
so an API process answers it exactly as the model process would have (server/errors.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import logging
import pickle
import struct
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from .errors import RetryLaterError

log = logging.getLogger(__name__)
_LENGTH = struct.Struct("!I")
Handler = Callable[..., Awaitable[Any]]
# Which connection a handler is serving (set per connection; tasks inherit it): state a handler keeps
# for one API process (its admitted requests, its images on their way) is dropped when it goes away.
current_peer: contextvars.ContextVar[int] = contextvars.ContextVar("current_peer", default=-1)


class LinkDownError(RetryLaterError):
    """The model process is not answering (starting, restarting or gone): 503 with Retry-After."""


async def _read(reader: asyncio.StreamReader) -> Any:
    (n,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    return pickle.loads(await reader.readexactly(n))


def _frame(message: Any) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(body)) + body


def _pack_error(exc: BaseException) -> tuple[type, tuple, dict]:
    """An exception as its class, args and attributes (``field``): pickling an exception keeps only
    its args, and ours carry more."""
    return type(exc), exc.args, {k: v for k, v in vars(exc).items() if not k.startswith("_")}


def _unpack_error(packed: tuple[type, tuple, dict]) -> BaseException:
    kind, args, attributes = packed
    exc = kind.__new__(kind)
    BaseException.__init__(exc, *args)
    exc.__dict__.update(attributes)
    return exc


class LinkServer:
    """The model process's side: ``handlers`` by method name, served on a Unix socket at ``path``."""

    def __init__(
        self,
        path: Path,
        handlers: Mapping[str, Handler],
        on_disconnect: Callable[[int], None] | None = None,
    ) -> None:
        """``on_disconnect(peer)``: a connection closed (``current_peer`` named it in its calls)."""
        self.path = Path(path)
        self.handlers = dict(handlers)
        self.on_disconnect = on_disconnect
        self._peers = itertools.count()
        self._server: asyncio.base_events.Server | None = None
        self._calls: set[asyncio.Task] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._connection, path=str(self.path))

    async def close(self) -> None:
        for task in list(self._calls):
            task.cancel()
        if self._server is not None:
            self._server.close()
            for writer in list(self._writers):  # wait_closed waits for every connection to end
                writer.close()
            await self._server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        peer = next(self._peers)
        current_peer.set(peer)  # this connection's task: the calls it starts inherit it
        try:
            while True:
                call_id, method, args, kwargs = await _read(reader)
                task = asyncio.create_task(self._call(writer, call_id, method, args, kwargs))
                self._calls.add(task)
                task.add_done_callback(self._calls.discard)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the API process went away; its calls in flight finish and find no one to answer
        finally:
            self._writers.discard(writer)
            writer.close()
            if self.on_disconnect is not None:
                self.on_disconnect(peer)

    async def _call(
        self, writer: asyncio.StreamWriter, call_id: int, method: str, args: tuple, kwargs: dict
    ) -> None:
        try:
            handler = self.handlers[method]
            answer = (call_id, True, await handler(*args, **kwargs))
        except Exception as exc:  # answered as itself; unexpected ones are logged here too
            if not getattr(exc, "expected", False) and getattr(exc, "status", 500) >= 500:
                log.exception("link call %s failed", method)
            answer = (call_id, False, _pack_error(exc))
        with contextlib.suppress(ConnectionError, RuntimeError):
            writer.write(_frame(answer))
            await writer.drain()


class LinkClient:
    """An API process's side: ``await client.call("method", ...)`` from any task of its event loop."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None

    @property
    def connected(self) -> bool:
        return self._writer is not None and not self._writer.is_closing()

    async def connect(self) -> None:
        reader, self._writer = await asyncio.open_unix_connection(str(self.path))
        self._reader_task = asyncio.create_task(self._answers(reader), name="link-answers")

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if not self.connected:
            raise LinkDownError("the model process is not reachable yet; retry shortly")
        call_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        try:
            self._writer.write(_frame((call_id, method, args, kwargs)))
            await self._writer.drain()
            return await future
        finally:
            self._pending.pop(call_id, None)

    async def wait_closed(self) -> None:
        """Until the link closes (the model process went away, or ``close``)."""
        if self._reader_task is not None:
            await asyncio.wait([self._reader_task])  # a waiter cancelled is cancelled; the link stays

    async def _answers(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                call_id, ok, result = await _read(reader)
                future = self._pending.get(call_id)
                if future is None or future.done():
                    continue  # the caller gave up (its client went away)
                if ok:
                    future.set_result(result)
                else:
                    future.set_exception(_unpack_error(result))
        except (asyncio.IncompleteReadError, ConnectionError):
            log.warning("the link to the model process closed")
        finally:
            if self._writer is not None:
                self._writer.close()
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(LinkDownError("the model process went away; retry shortly"))

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader_task
