"""Server-sent events: the one encoder of every event the proxy writes (`message_event`, `event_bytes`), and an
incremental text/event-stream parser (WHATWG rules) for reading upstream streams event by event.

Linear in its input whatever the chunking: each chunk is scanned once for line ends, a line split across chunks is
joined once, and nothing already parsed is copied again; past a few lines, a run of blank and comment lines (which
carry nothing) goes by in one regular-expression match rather than a Python step per line. An event (its lines, the
one in progress included) is bounded: past the bound, feed() raises SseLimitError instead of growing (comment lines
are dropped as they end, so they count only while in progress). A differential fuzz test checks it against the
decoder of the official Python SDK's HTTP client (httpx2, derived from httpx-sse); neither is used here because
their parsers are private to clients this proxy does not use, and httpx-sse's is unbounded.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import AsyncIterable, AsyncIterator, Iterator
from typing import Any

from ...jsonrpc import dumps, loads
from ..events import AnswerTooLarge

DEFAULT_MAX_EVENT_BYTES = 16 * 1024 * 1024
MAX_RETRY_MS = 30_000
"""The longest reconnection delay a peer's `retry:` field may ask for; longer ones are cut to this."""

_LINE_END = re.compile(rb"\r\n|\r|\n")
_IGNORED_LINES = re.compile(rb"(?:(?::[^\r\n]*)?(?:\r\n|\r|\n))++")
"""Whole comment and blank lines, each with its line end (CRLF taken whole, as _LINE_END does). Possessive: a
greedy `+` over the group keeps a backtracking entry per line (670 MB for 6.5 MB of comment lines)."""
_PADDING_LINES = 8
"""Blank and comment lines in a row handled one by one before the rest of their run is matched at once: a short run
costs what a line costs, a long one about a regular-expression step a line."""
_BLANK_LINE = re.compile(rb"[\r\n]")
_BLANK_IN_RUN = re.compile(rb"\n[\r\n]|\r\r")
"""Within a run of whole lines, a blank line is a line end where a line starts: after LF, or after a lone CR (CR
then LF is one CRLF end)."""
_BOM = b"\xef\xbb\xbf"


KEEP_ALIVE = b": keep-alive\n\n"
"""A comment: it keeps an idle stream's connections open and dispatches nothing."""


def event_bytes(
    data: str | bytes,
    *,
    event: str | None = "message",
    event_id: str | None = None,
    retry_ms: int | None = None,
) -> bytes:
    """One event: its name (None: the default, unnamed), its id and reconnection delay when it has them, and `data`
    as one data line per line (a line end inside it would otherwise end the field early)."""
    raw = data.encode() if isinstance(data, str) else data
    head = b"event: %s\n" % event.encode() if event is not None else b""
    if event_id is not None:
        head += b"id: %s\n" % event_id.encode()
    if retry_ms is not None:
        head += b"retry: %d\n" % retry_ms
    if not raw:
        return head + b"data:\n\n"
    if b"\n" in raw or b"\r" in raw:
        return head + b"".join(b"data: %s\n" % line for line in _LINE_END.split(raw)) + b"\n"
    return head + b"data: " + raw + b"\n\n"


def message_event(message: Any, *, event_id: str | None = None) -> bytes:
    """A JSON-RPC message as an event (`message`, as MCP's Streamable HTTP names them)."""
    return event_bytes(dumps(message), event_id=event_id)


class SseLimitError(ValueError, AnswerTooLarge):
    """An event is larger than the parser's bound; the stream cannot be read on."""


@dataclasses.dataclass(frozen=True, slots=True)
class SseEvent:
    data: str
    event: str = "message"
    id: str | None = None
    retry_ms: int | None = None


class SseParser:
    """Feed bytes as they arrive; complete events come out. Lines may end in CRLF, LF or CR."""

    def __init__(self, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self._max_event_bytes = max_event_bytes
        self._partial = bytearray()
        """The line in progress (no line end seen yet)."""
        self._event_bytes = 0
        """Bytes of the complete lines of the event in progress."""
        self._skip_lf = False
        """The last chunk ended in CR: a LF that starts the next one belongs to that line end."""
        self._started = False
        self._data = bytearray()
        """The event's data lines, joined by LF as they come: bytes, decoded once at dispatch (a list of str per
        line would cost several times the event's size)."""
        self._has_data = False
        self._event = ""
        self._id: str | None = None
        self._retry: int | None = None

    def feed(self, chunk: bytes) -> list[SseEvent]:
        position = 0
        if not self._started:
            # One leading byte-order mark is dropped; until three bytes came, it may still be one.
            chunk = bytes(self._partial) + chunk
            self._partial.clear()
            if len(chunk) < len(_BOM) and _BOM.startswith(chunk):
                self._partial += chunk
                return []
            self._started = True
            if chunk.startswith(_BOM):
                position = len(_BOM)
        if self._skip_lf:
            self._skip_lf = False
            if chunk[position : position + 1] == b"\n":
                position += 1
        events: list[SseEvent] = []
        padding = 0  # blank and comment lines in a row, handled one by one until a run looks long
        scan: Iterator[re.Match[bytes]] | None = _LINE_END.finditer(chunk, position)
        while scan is not None:
            for match in scan:
                start, end = match.span()
                if self._partial:
                    self._partial += chunk[position:start]
                    line = bytes(self._partial)
                    self._partial.clear()
                else:
                    line = chunk[position:start]
                position = end
                if line and line[:1] != b":":
                    padding = 0
                    self._event_bytes += len(line) + 1
                    if self._event_bytes > self._max_event_bytes:
                        raise SseLimitError(f"an event of the stream exceeds {self._max_event_bytes} bytes")
                    self._line(line)
                    continue
                # A blank line ends the event; a comment (a keep-alive) is dropped as it ends, counting toward no
                # bound. Past a few in a row (a peer's padding), the rest of the run goes by in one C-level match:
                # those lines change nothing but a second dispatch, which finds no event.
                blank = not line
                run = None
                padding += 1
                if padding >= _PADDING_LINES and (run := _IGNORED_LINES.match(chunk, position)) is not None:
                    start, position = position, run.end()
                    blank = blank or _BLANK_LINE.match(chunk, start) is not None
                    blank = blank or _BLANK_IN_RUN.search(chunk, start, position) is not None
                if blank:
                    self._event_bytes = 0
                    event = self._dispatch()
                    if event is not None:
                        events.append(event)
                if run is not None:
                    padding = 0
                    scan = _LINE_END.finditer(chunk, position)  # on from the end of the run
                    break
            else:
                scan = None
        if position and chunk[position - 1 : position] == b"\r" and position == len(chunk):
            self._skip_lf = True
        if position < len(chunk):
            self._partial += chunk[position:]
            if self._event_bytes + len(self._partial) > self._max_event_bytes:
                raise SseLimitError(f"an event of the stream exceeds {self._max_event_bytes} bytes")
        return events

    def _line(self, line: bytes) -> None:
        field, _, value = line.partition(b":")
        if value.startswith(b" "):
            value = value[1:]
        if field == b"data":
            if self._has_data:
                self._data += b"\n"
            self._data += value
            self._has_data = True
        elif field == b"event":
            self._event = value.decode("utf-8", errors="replace")
        elif field == b"id":
            if b"\0" not in value:
                self._id = value.decode("utf-8", errors="replace")
        elif field == b"retry" and value.isdigit():  # bytes.isdigit: ASCII digits only
            # Clamped before int(): a peer's 10,000-digit delay must cost neither a parse nor an overflow.
            self._retry = MAX_RETRY_MS if len(value) > 9 else min(int(value), MAX_RETRY_MS)

    def _dispatch(self) -> SseEvent | None:
        if not self._has_data and self._retry is None and not self._event:
            # An id-only event (a 2025-11-25 priming event) carries no message; its id is kept as the cursor.
            return None
        data = self._data.decode("utf-8", errors="replace")
        event = SseEvent(data=data, event=self._event or "message", id=self._id, retry_ms=self._retry)
        self._data.clear()
        self._has_data = False
        self._event = ""
        self._retry = None
        return event


async def iter_events(
    chunks: AsyncIterable[bytes], max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES
) -> AsyncIterator[SseEvent]:
    parser = SseParser(max_event_bytes)
    async for chunk in chunks:
        for event in parser.feed(chunk):
            yield event


def json_message(event: SseEvent) -> dict[str, Any] | None:
    """The JSON-RPC message an event carries; None for priming events, keep-alives and anything not a JSON object."""
    if not event.data:
        return None
    try:
        message = loads(event.data)
    except ValueError:
        return None
    return message if isinstance(message, dict) else None


@dataclasses.dataclass(slots=True)
class StreamPosition:
    """Where a resumable event stream stands (2025-11-25 resumability): the last event id seen, and the server's
    retry delay, for the GET + Last-Event-ID that picks it up again."""

    last_event_id: str | None = None
    retry_ms: int = 1000

    def messages(self, parser: SseParser, chunk: bytes) -> Iterator[dict[str, Any]]:
        """The JSON-RPC messages of one chunk, the position kept up to date as its events go by."""
        for event in parser.feed(chunk):
            if event.id is not None:
                self.last_event_id = event.id
            if event.retry_ms is not None:
                self.retry_ms = event.retry_ms
            message = json_message(event)
            if message is not None:
                yield message
