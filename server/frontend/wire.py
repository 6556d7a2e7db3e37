"""Images between an API process and the model process: the payload in shared memory, a note of
where it lies over the socket.

What the model process's pipeline awaits is either one tensor ``(n, C, H, W)`` (the CPU decoder's
images, stacked) or a list of per-image items, each a ``Tensor (C, H, W)`` or an
``Encoded`` JPEG still to be decoded on the device (server/inference/device_decode.py). ``pack`` writes each
tensor's bytes (any dtype) or JPEG's bytes into the writer's arena once; ``unpack`` maps them back
where they lie (``torch.frombuffer`` over the shared mapping, no copy), valid until the writer frees
the tickets, which it does only once the model process has answered the call that read them. A
payload that does not fit in the arena travels inline in the call: slower, never refused.
"""

from __future__ import annotations

from typing import Union

import torch
from torch import Tensor

from ..inference.device_decode import Encoded
from .shm_arena import Arena, Reader, Ticket

Images = Union[Tensor, list[Union[Tensor, Encoded]]]  # noqa: UP007 (a runtime alias, py3.10)


# Notes are plain tuples: unpickled for every request, a tuple costs a sixth of a dataclass.
# ("t", data, shape, dtype): a tensor's bytes (any dtype, torch's name, e.g. "float32");
# ("j", data, name, orientation): a JPEG's bytes, for the device decoder.
# ``data``: (arena, offset, length) in shared memory, or the bytes themselves (inline).
Note = tuple
Payload = Union[Note, list[Note]]  # noqa: UP007


def _put(arena: Arena | None, data: memoryview | bytes, tickets: list[Ticket]) -> tuple | bytes:
    ticket = arena.put(data) if arena is not None else None
    if ticket is None:
        return bytes(data)
    tickets.append(ticket)
    return (ticket.arena, ticket.offset, ticket.length)


def _tensor(arena: Arena | None, tensor: Tensor, tickets: list[Ticket]) -> Note:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    raw = memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")
    dtype = str(tensor.dtype).removeprefix("torch.")
    return ("t", _put(arena, raw, tickets), tuple(tensor.shape), dtype)


def pack(images: Images, arena: Arena | None) -> tuple[Payload, list[Ticket]]:
    """``images`` as a payload for ``unpack``, and the arena tickets to free once it was read."""
    tickets: list[Ticket] = []
    if isinstance(images, Tensor):
        return _tensor(arena, images, tickets), tickets
    notes: list[Note] = []
    for item in images:
        if isinstance(item, Encoded):
            notes.append(("j", _put(arena, item.data, tickets), item.name, item.orientation))
        else:
            notes.append(_tensor(arena, item, tickets))
    return notes, tickets


def _bytes_of(data: tuple | bytes, reader: Reader) -> memoryview | bytearray:
    return reader.view_at(*data) if isinstance(data, tuple) else bytearray(data)


def _unpack_tensor(note: Note, reader: Reader) -> Tensor:
    _, data, shape, dtype_name = note
    dtype = getattr(torch, dtype_name)
    raw = _bytes_of(data, reader)
    if len(raw) == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).view(shape)


def unpack(payload: Payload, reader: Reader) -> Images:
    """The images ``pack`` wrote: tensors over the shared memory itself, JPEG bytes copied out."""
    if isinstance(payload, tuple):
        return _unpack_tensor(payload, reader)
    items: list[Tensor | Encoded] = []
    for note in payload:
        if note[0] == "j":
            _, data, name, orientation = note
            # A bytearray: the device decoder reads it in place (torch.frombuffer needs it writable).
            raw = bytearray(reader.view_at(*data)) if isinstance(data, tuple) else data
            items.append(Encoded(raw, name, orientation))
        else:
            items.append(_unpack_tensor(note, reader))
    return items
