"""What a client sends on a lane connection ahead of the answer it waits for (pipelined requests): kept in small
pieces and fed back a piece at a time, so that a request costs its own bytes and one piece however much is queued
behind it; the connection is not read while more than MAX_BYTES wait."""

from __future__ import annotations

import asyncio
import collections

MAX_BYTES = 64 * 1024
PIECE_BYTES = 2 * 1024


class Backlog:
    """One connection's unparsed bytes, in order."""

    __slots__ = ("_pieces", "size", "_paused")

    def __init__(self) -> None:
        self._pieces: collections.deque[bytes] = collections.deque()
        self.size = 0
        """Bytes received and not yet parsed."""
        self._paused = False

    def __bool__(self) -> bool:
        return bool(self._pieces)

    def put(self, data: bytes, transport: asyncio.Transport | None, *, first: bool = False) -> None:
        """Keep `data` (`first`: before what waits already); stop reading `transport` past MAX_BYTES."""
        pieces = [data[i : i + PIECE_BYTES] for i in range(0, len(data), PIECE_BYTES)]
        if first:
            self._pieces.extendleft(reversed(pieces))
        else:
            self._pieces.extend(pieces)
        self.size += len(data)
        if self.size > MAX_BYTES and not self._paused and transport is not None:
            self._paused = True
            transport.pause_reading()

    def take(self) -> bytes:
        """The next piece."""
        piece = self._pieces.popleft()
        self.size -= len(piece)
        return piece

    def make_room(self, transport: asyncio.Transport | None) -> None:
        """Read `transport` again once what waits is back under MAX_BYTES."""
        if self._paused and self.size <= MAX_BYTES and transport is not None:
            self._paused = False
            transport.resume_reading()

    def take_all(self, transport: asyncio.Transport) -> bytes:
        """Everything that waits, and `transport` read again (the connection changes hands)."""
        data = b"".join(self._pieces)
        self._pieces.clear()
        self.size = 0
        if self._paused:
            self._paused = False
            transport.resume_reading()
        return data
