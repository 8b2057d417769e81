"""The event-stream parser: every line ending, split chunks, comments, ids, multi-line data."""

from __future__ import annotations

import pytest

from proxy.sse import SseEvent, SseParser

STREAM = (
    b'event: message\r\nid: 1\r\ndata: {"a":1}\r\n\r\n'  # CRLF
    b": keep-alive\n\n"  # a comment
    b"id: 2\ndata: x\ndata: y\n\n"  # LF, two data lines
    b"retry: 3000\ndata: z\r\r"  # CR
)
EXPECTED = [
    SseEvent(data='{"a":1}', event="message", id="1"),
    SseEvent(data="x\ny", id="2"),
    SseEvent(data="z", id="2", retry_ms=3000),
]


def test_whole_stream():
    assert SseParser().feed(STREAM) == EXPECTED


@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_any_chunking_gives_the_same_events(size):
    parser = SseParser()
    events = []
    for start in range(0, len(STREAM), size):
        events.extend(parser.feed(STREAM[start : start + size]))
    assert events == EXPECTED


def test_priming_event_with_only_an_id_is_not_a_message_but_sets_the_cursor():
    parser = SseParser()
    assert parser.feed(b"id: 42\n\n") == []
    assert parser.feed(b"data: hello\n\n") == [SseEvent(data="hello", id="42")]


def test_unfinished_event_is_held_back():
    parser = SseParser()
    assert parser.feed(b"data: partial") == []
    assert parser.feed(b"\n\n") == [SseEvent(data="partial")]
