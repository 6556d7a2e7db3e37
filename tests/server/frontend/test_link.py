"""The pieces between API processes and the model process: the shared-memory arena
(server/frontend/shm_arena.py) and the framed calls over a Unix socket (server/frontend/link.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading

import pytest

from memvit.server.errors import BrokenImageError
from memvit.server.frontend.link import LinkDownError, LinkServer, _frame
from memvit.server.frontend.link_client import LinkClient
from memvit.server.frontend.shm_arena import Arena, Reader


@pytest.fixture
def arena():
    arena = Arena(1000)
    yield arena
    arena.close()


def test_payloads_are_read_where_they_lie_and_regions_come_back(arena) -> None:
    reader = Reader()
    a, b = arena.put(b"a" * 400), arena.put(b"b" * 400)
    assert reader.read(a) == b"a" * 400 and bytes(reader.view(b)) == b"b" * 400
    assert arena.put(b"c" * 400) is None  # 200 bytes left: the caller sends this one inline
    arena.free(b)  # out of order: a still holds the ring's tail
    assert arena.held == 400 and arena.put(b"c" * 300) is None
    arena.free(a)
    c = arena.put(b"c" * 300)  # everything free: from the start again
    assert c.offset == 0 and reader.read(c) == b"c" * 300
    d, e = arena.put(b"d" * 600), arena.put(b"e" * 200)
    assert d.offset == 300 and e is None  # past the end, and the start is held
    arena.free(c)
    e = arena.put(b"e" * 250)  # wraps around into the freed start
    assert e.offset == 0 and reader.read(d) == b"d" * 600 and reader.read(e) == b"e" * 250
    assert arena.put(b"") is None and arena.put(b"x" * 1001) is None
    reader.close()


def test_another_process_reads_the_arena(arena) -> None:
    ticket = arena.put(b"from the API process")
    where = f"Ticket({ticket.arena!r}, {ticket.offset}, {ticket.length})"
    program = (
        "import sys; from memvit.server.frontend.shm_arena import Reader, Ticket; r = Reader(); "
        f"sys.stdout.buffer.write(r.read({where})); r.close()"
    )
    child = subprocess.run([sys.executable, "-c", program], capture_output=True, timeout=60, check=True)
    assert child.stdout == b"from the API process"
    assert arena.put(b"still mine") is not None  # the reader left the writer's memory alone


async def _linked(tmp_path, handlers, inline=None):
    server = LinkServer(tmp_path / "link.sock", handlers, loop=asyncio.get_running_loop(), inline=inline)
    await server.start()
    client = LinkClient(tmp_path / "link.sock")
    await client.connect()
    return server, client


def test_calls_in_flight_are_answered_in_any_order_and_errors_keep_their_kind(tmp_path) -> None:
    async def slow(x: int) -> int:
        await asyncio.sleep(0.2 if x == 0 else 0)
        return x * 10

    async def refuse(name: str) -> None:
        raise BrokenImageError(f"{name}: damaged", field=name)

    async def scenario() -> None:
        server, client = await _linked(tmp_path, {"slow": slow, "refuse": refuse})
        first = asyncio.create_task(client.call("slow", 0))
        assert await client.call("slow", 1) == 10  # answered while the first call still waits
        assert not first.done() and await first == 0
        with pytest.raises(BrokenImageError) as refused:
            await client.call("refuse", "photo.jpg")
        assert refused.value.field == "photo.jpg" and str(refused.value) == "photo.jpg: damaged"
        assert refused.value.status == 400
        pending = asyncio.create_task(client.call("slow", 0))
        await asyncio.sleep(0.05)
        await server.close()  # the model process goes away: calls in flight get a 503, not a hang
        with pytest.raises(LinkDownError):
            await pending
        with pytest.raises(LinkDownError):
            await client.call("slow", 1)
        await client.close()

    asyncio.run(scenario())


def test_inline_calls_are_answered_from_any_thread_without_the_event_loop(tmp_path) -> None:
    """The data path's calls run on the connection's reader thread and are answered later, from
    another thread, several answers in one write; the event loop is never involved."""
    answered_on: list[str] = []
    waiting: list = []

    def run(connection, call_id, x: int) -> None:  # queues work and returns at once
        waiting.append((connection, call_id, x))
        if len(waiting) == 3:
            threading.Thread(target=answer_all).start()

    def answer_all() -> None:
        answered_on.append(threading.current_thread().name)
        connection = waiting[0][0]
        frames = []
        for _, call_id, x in waiting:
            frames.append(_frame((call_id, True, x + 1)))
        connection.send(frames)

    async def scenario() -> list[int]:
        loop = asyncio.get_running_loop()
        server, client = await _linked(tmp_path, {}, inline={"run": run})
        blocked = threading.Event()
        loop.call_soon(lambda: blocked.wait(0.5))  # the event loop busy: inline calls do not wait on it
        results = await asyncio.gather(*(client.call("run", x) for x in range(3)))
        with pytest.raises(KeyError):
            await client.call("missing")
        await client.close()
        await server.close()
        return results

    assert asyncio.run(scenario()) == [1, 2, 3]
    assert answered_on and answered_on[0] != "MainThread"


def test_a_call_amended_before_its_turn_ends_leaves_as_one_frame(tmp_path) -> None:
    """``amend`` adds arguments to a call still unwritten (a request's images joining its "run");
    once the turn's frames have left it says so, and the caller sends them apart."""
    got: list[tuple] = []

    def run(connection, call_id, *args) -> None:
        got.append(args)
        connection.answer(call_id, True, len(args))

    async def scenario() -> tuple:
        server, client = await _linked(tmp_path, {}, inline={"run": run})
        joined, message = client.open_call("run", 1)
        assert client.amend(message, "images")
        assert await joined == 2
        alone, message = client.open_call("run", 2)
        await asyncio.sleep(0)  # the turn ends: its frames leave
        await asyncio.sleep(0)
        late = client.amend(message, "images")
        assert await alone == 1
        await client.close()
        await server.close()
        return late

    assert asyncio.run(scenario()) is False
    assert got == [(1, "images"), (2,)]


def test_answers_leave_in_order_and_a_full_socket_never_blocks_the_sender() -> None:
    """A connection's answers are sent by the thread that has them when the socket takes them at
    once; what a full socket does not take waits for the writer thread, and whatever is sent
    meanwhile leaves after it: the peer reads every byte, in order, and no sender waits on it."""
    import socket
    import time

    from memvit.server.frontend.link import Connection

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    connection = Connection(ours, peer=0)
    big = bytes(range(256)) * (32 << 10)  # 8 MiB: more than the socket's buffer holds
    small = [f"frame {i};".encode() for i in range(200)]
    started = time.monotonic()
    connection.send([b"first;"])
    connection.send([big])  # the peer reads nothing yet: most of it is left to the writer
    senders = [threading.Thread(target=lambda part=part: [connection.send([f]) for f in part])
               for part in (small[:100], small[100:])]  # fmt: skip
    for thread in senders:
        thread.start()
    for thread in senders:
        thread.join()
    assert time.monotonic() - started < 2.0  # nobody waited for the peer to read
    expected = len(b"first;") + len(big) + sum(map(len, small))
    received = bytearray()
    theirs.settimeout(10)
    while len(received) < expected:
        received += theirs.recv(1 << 20)
    assert received.startswith(b"first;" + big)
    rest = bytes(received[len(b"first;") + len(big) :]).split(b";")[:-1]
    assert sorted(rest) == sorted(f.rstrip(b";") for f in small)
    for part in (small[:100], small[100:]):  # each sender's frames in the order it sent them
        mine = [f.rstrip(b";") for f in part]
        assert [r for r in rest if r in set(mine)] == mine
    connection.close()
    theirs.close()
