"""What a request holds while its adapters load and its batch runs: a ``Pin`` on them, and one
``Load`` per adapter in flight, shared by every request that asks for it (single flight)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future


class Pin:
    """Adapters one request holds resident until its batch has run. ``release`` once, when done."""

    def __init__(self, unpin: Callable[[tuple[str, ...]], None], names: tuple[str, ...]) -> None:
        self._unpin, self.names, self._held = unpin, names, True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._unpin(self.names)

    def drop(self, name: str) -> None:
        """Stop holding ``name`` (it could not be loaded and the request goes on without it)."""
        if self._held and name in self.names:
            self._unpin((name,))
            self.names = tuple(n for n in self.names if n != name)

    def __enter__(self) -> Pin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Load:
    """One adapter's load in flight: the first to claim it runs it, everyone else waits on ``future``."""

    __slots__ = ("_claimed", "_lock", "future")

    def __init__(self) -> None:
        self.future: Future[None] = Future()
        # Running from the start: a waiter that is cancelled (a client gone) cannot cancel the load
        # for the others (asyncio.wrap_future cancels the future it wraps; a running one ignores it).
        self.future.set_running_or_notify_cancel()
        self._claimed = False
        self._lock = threading.Lock()

    def claim(self) -> bool:
        with self._lock:
            claimed, self._claimed = self._claimed, True
            return not claimed


def when_loaded(
    pin: Pin,
    loads: list[tuple[str, Load]],
    settle: Callable[[str, Load], None],
    then: Callable[[Pin | BaseException], None],
) -> None:
    """``then(pin)`` once every load is done and ``settle``d (at once when there are none, else on the
    thread that finished the last one); ``then(error)``, with ``pin`` released, when one failed."""

    def finish() -> None:
        try:
            for name, load in loads:
                settle(name, load)
        except BaseException as exc:
            pin.release()
            then(exc)
            return
        then(pin)

    if not loads:
        then(pin)
        return
    left = [len(loads)]
    lock = threading.Lock()

    def one_done(_: object) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        finish()

    for _, load in loads:
        load.future.add_done_callback(one_done)
