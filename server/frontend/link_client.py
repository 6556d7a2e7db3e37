"""The link's API-process side: ``LinkClient``, calls to the model process from one event loop.

Frames and errors as link.py defines them; any number of calls in flight, each answered by its
call id in whatever order the model process answers. A link that closes fails every call still
waiting with ``LinkDownError`` (503, Retry-After). The frames written during one turn of the event
loop leave in one write at its end (every request's call and delivery of that turn: one system
call and one wake-up of the model process's reader for all of them), in the order they were made;
until then a call can still be amended (``amend``: a request's images joining its ``run``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .link import BATCH, NOTIFY, LinkDownError, _frame, _read, _unpack_error

log = logging.getLogger("memvit.server.frontend.link")  # the link's one logger


class LinkClient:
    """An API process's side: ``await client.call("method", ...)`` from any task of its event loop."""

    def __init__(self, path: Path, on_notice: Callable[..., None] | None = None) -> None:
        """``on_notice(method, *args)``: a notice the model process sends on its own (``broadcast``)."""
        self.path = Path(path)
        self.on_notice = on_notice
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._out: list[list] = []  # this turn's messages, framed and written at its end (``_flush``)

    @property
    def connected(self) -> bool:
        return self._writer is not None and not self._writer.is_closing()

    async def connect(self) -> None:
        reader, self._writer = await asyncio.open_unix_connection(str(self.path))
        self._reader_task = asyncio.create_task(self._answers(reader), name="link-answers")

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        future = self.send(method, *args, **kwargs)
        self._flush()  # then the writer's flow control, as for a frame written at once
        await self._writer.drain()
        return await future

    def send(self, method: str, *args: Any, **kwargs: Any) -> asyncio.Future:
        """The call queued now (so calls and notifications leave in the order they are made); the
        future of its answer."""
        return self.open_call(method, *args, **kwargs)[0]

    def open_call(self, method: str, *args: Any, **kwargs: Any) -> tuple[asyncio.Future, list]:
        """``send``, and the call's message: until this turn's frames leave, ``amend`` adds to it."""
        if not self.connected:
            raise LinkDownError("the model process is not reachable yet; retry shortly")
        call_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        future.add_done_callback(lambda _: self._pending.pop(call_id, None))
        message = [call_id, method, args, kwargs, False]  # the last: written
        self._write(message)
        return future, message

    @staticmethod
    def amend(message: list, *args: Any) -> bool:
        """``args`` added to a call not yet written (one frame, one read and one dispatch in the model
        process instead of two); False when it has left (send them in a call of their own)."""
        if message[4]:
            return False
        message[2] = (*message[2], *args)
        return True

    def notify(self, method: str, *args: Any) -> None:
        """A call nobody waits for (its answer is never sent): a delivery, a release."""
        if not self.connected:
            raise LinkDownError("the model process is not reachable; retry shortly")
        self._write([NOTIFY, method, args, {}, False])

    def _write(self, message: list) -> None:
        if not self._out:
            asyncio.get_running_loop().call_soon(self._flush)
        self._out.append(message)

    def _flush(self) -> None:
        out, self._out = self._out, []
        for message in out:
            message[4] = True
        if out and self._writer is not None and not self._writer.is_closing():
            self._writer.write(b"".join([_frame(tuple(m[:4])) for m in out]))

    async def wait_closed(self) -> None:
        """Until the link closes (the model process went away, or ``close``)."""
        if self._reader_task is not None:
            await asyncio.wait([self._reader_task])  # a waiter cancelled is cancelled; the link stays

    async def _answers(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                call_id, ok, result = await _read(reader)
                if call_id == NOTIFY:  # the model process's own notice: (NOTIFY, method, args)
                    if self.on_notice is not None:
                        self.on_notice(ok, *result)
                elif call_id == BATCH:  # a batch's answers: one frame, one read
                    for answer in result:
                        self._settle(*answer)
                else:
                    self._settle(call_id, ok, result)
        except (asyncio.IncompleteReadError, ConnectionError):
            log.warning("the link to the model process closed")
        finally:
            if self._writer is not None:
                self._writer.close()
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(LinkDownError("the model process went away; retry shortly"))

    def _settle(self, call_id: int, ok: bool, result: Any) -> None:
        future = self._pending.get(call_id)
        if future is None or future.done():
            return  # the caller gave up (its client went away)
        if ok:
            future.set_result(result)
        else:
            future.set_exception(_unpack_error(result))

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader_task
