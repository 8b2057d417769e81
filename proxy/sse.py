"""An incremental text/event-stream parser (WHATWG rules) for reading upstream streams event by event."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any


@dataclasses.dataclass(frozen=True, slots=True)
class SseEvent:
    data: str
    event: str = "message"
    id: str | None = None
    retry_ms: int | None = None


class SseParser:
    """Feed bytes as they arrive; complete events come out. Lines may end in CRLF, LF or CR."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []
        self._event = ""
        self._id: str | None = None
        self._retry: int | None = None
        self._pending_cr = False

    def feed(self, chunk: bytes) -> list[SseEvent]:
        if self._pending_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]  # the LF of a CRLF split across two chunks
        self._pending_cr = False
        self._buffer += chunk
        events: list[SseEvent] = []
        while True:
            cut = _line_end(self._buffer)
            if cut is None:
                break
            start, end = cut
            line = self._buffer[:start].decode("utf-8", errors="replace")
            self._buffer = self._buffer[end:]
            event = self._line(line)
            if event is not None:
                events.append(event)
        if self._buffer.endswith(b"\r"):
            # A trailing CR is a complete line end; remember it so that a following LF is not a blank line.
            line = self._buffer[:-1].decode("utf-8", errors="replace")
            self._buffer = b""
            self._pending_cr = True
            event = self._line(line)
            if event is not None:
                events.append(event)
        return events

    def _line(self, line: str) -> SseEvent | None:
        if line == "":
            return self._dispatch()
        if line.startswith(":"):
            return None
        field, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._event = value
        elif field == "id":
            if "\0" not in value:
                self._id = value
        elif field == "retry" and value.isdigit():
            self._retry = int(value)
        return None

    def _dispatch(self) -> SseEvent | None:
        if not self._data and self._retry is None and not self._event:
            # An id-only event (a 2025-11-25 priming event) carries no message; its id is kept as the cursor.
            return None
        event = SseEvent(data="\n".join(self._data), event=self._event or "message", id=self._id, retry_ms=self._retry)
        self._data = []
        self._event = ""
        self._retry = None
        return event


def _line_end(buffer: bytes) -> tuple[int, int] | None:
    """Position of the first complete line end: (end of the line's text, start of the next line)."""
    lf = buffer.find(b"\n")
    cr = buffer.find(b"\r", 0, lf if lf >= 0 else len(buffer))
    if cr < 0:
        return (lf, lf + 1) if lf >= 0 else None
    if cr + 1 == len(buffer):
        return None  # a CR at the end: wait to see whether LF follows
    return cr, cr + 2 if buffer[cr + 1] == 0x0A else cr + 1


async def iter_events(chunks: AsyncIterable[bytes]) -> AsyncIterator[SseEvent]:
    parser = SseParser()
    async for chunk in chunks:
        for event in parser.feed(chunk):
            yield event


def json_message(event: SseEvent) -> dict[str, Any] | None:
    """The JSON-RPC message an event carries; None for priming events, keep-alives and anything not a JSON object."""
    if not event.data:
        return None
    try:
        message = json.loads(event.data)
    except ValueError:
        return None
    return message if isinstance(message, dict) else None
