"""Frames between the reward pool and its workers: an 8-byte length, then a pickle."""
from __future__ import annotations

import os
import pickle
import struct
from typing import Any

_HEADER = struct.Struct("<Q")


def send(fd: int, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def recv(fd: int) -> Any | None:
    """The next frame, or None at end of file (the pool closed the pipe or died)."""
    header = _read_exact(fd, _HEADER.size)
    if header is None:
        return None
    body = _read_exact(fd, _HEADER.unpack(header)[0])
    return None if body is None else pickle.loads(body)


class FrameReader:
    """Frames from a non-blocking pipe, fed as bytes arrive (the pool's side)."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        self.buffer += data
        out = []
        while len(self.buffer) >= _HEADER.size:
            n = _HEADER.unpack_from(self.buffer)[0]
            if len(self.buffer) < _HEADER.size + n:
                break
            out.append(pickle.loads(bytes(self.buffer[_HEADER.size:_HEADER.size + n])))
            del self.buffer[:_HEADER.size + n]
        return out
