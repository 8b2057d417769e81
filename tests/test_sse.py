"""The event-stream parser: every line ending, split chunks, comments, ids, multi-line data."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mcp_tasks_proxy.upstream.http import sse
from mcp_tasks_proxy.upstream.http.sse import SseEvent, SseLimitError, SseParser

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


def test_a_byte_order_mark_at_the_start_is_dropped_even_when_split():
    parser = SseParser()
    assert parser.feed(b"\xef") == []
    assert parser.feed(b"\xbb\xbfdata: a\n\n") == [SseEvent(data="a")]


def test_an_event_over_the_bound_raises_instead_of_growing():
    parser = SseParser(max_event_bytes=1000)
    assert parser.feed(b"data: " + b"a" * 500 + b"\n\n") == [SseEvent(data="a" * 500)]
    with pytest.raises(SseLimitError, match="exceeds 1000 bytes"):
        for _ in range(100):
            parser.feed(b"data: " + b"b" * 100 + b"\n")  # many lines of one event
    parser = SseParser(max_event_bytes=1000)
    with pytest.raises(SseLimitError):
        for _ in range(100):
            parser.feed(b"x" * 100)  # one line that never ends


def test_comment_lines_are_dropped_as_they_end_and_count_toward_no_bound():
    parser = SseParser(max_event_bytes=1000)
    assert parser.feed(b": keep-alive\n" * 10_000 + b"data: x\n\n") == [SseEvent(data="x")]
    with pytest.raises(SseLimitError):
        parser.feed(b": a comment that never ends" * 100)  # held while in progress, so bounded


def test_each_byte_is_scanned_once_and_copied_at_most_once(monkeypatch):
    # Counted, not timed: 1 MB of short lines, and one long line, fed whole and in 7-byte pieces. The quadratic
    # parser this replaced copied the rest of its buffer at every line.
    counts = {"scanned": 0, "joined": 0}
    real = sse._LINE_END

    class CountingPattern:
        def finditer(self, chunk: bytes, position: int):
            counts["scanned"] += len(chunk) - position
            return real.finditer(chunk, position)

    class CountingBytearray(bytearray):
        def __iadd__(self, other):  # type: ignore[override]
            counts["joined"] += len(other)
            return super().__iadd__(other)

    monkeypatch.setattr(sse, "_LINE_END", CountingPattern())
    stream = b"data: x\n" * 131_072 + b"\n" + b"data: " + b"y" * 300_000 + b"\n\n"
    for size in (len(stream), 7):
        counts.update(scanned=0, joined=0)
        parser = SseParser()
        parser._partial = CountingBytearray()
        events = []
        for start in range(0, len(stream), size):
            events.extend(parser.feed(stream[start : start + size]))
        assert [len(event.data) for event in events] == [131_072 * 2 - 1, 300_000]
        assert counts["scanned"] <= len(stream)
        assert counts["joined"] <= len(stream)


@pytest.mark.parametrize("unit", [b"\n", b"\r", b"\r\n", b":\n", b": ping\r\n\r\n", b"\n:\r"])
def test_padding_of_blank_and_comment_lines_takes_no_python_step_per_line(monkeypatch, unit):
    # Counted, not timed: an upstream's 1 MB of blank lines or bare comments, around two events, cost a Python step
    # (a line end handed to the loop) per line before: 1 MB of LF took 0.28 s, 0.06 s now (docs/security.md).
    steps = {"line ends": 0, "dispatches": 0}
    real, dispatch = sse._LINE_END, SseParser._dispatch

    class CountingPattern:
        def finditer(self, chunk: bytes, position: int):
            for match in real.finditer(chunk, position):
                steps["line ends"] += 1
                yield match

    def counted_dispatch(self):
        steps["dispatches"] += 1
        return dispatch(self)

    monkeypatch.setattr(sse, "_LINE_END", CountingPattern())
    monkeypatch.setattr(SseParser, "_dispatch", counted_dispatch)
    padding = unit * (1_000_000 // len(unit))
    stream = b"id: 1\ndata: a\n\n" + padding + b"\ndata: b\n\n" + padding
    parser, events = SseParser(), []
    for start in range(0, len(stream), 65536):
        events.extend(parser.feed(stream[start : start + 65536]))
    assert [(event.data, event.id) for event in events] == [("a", "1"), ("b", "1")]
    # The events' own lines, and a few lines of padding at the start of each chunk, before a run looks long.
    per_chunk = sse._PADDING_LINES + 2
    chunks = len(stream) // 65536 + 1
    assert steps["line ends"] <= 6 + per_chunk * chunks
    assert steps["dispatches"] <= per_chunk * chunks
    # Fed whole (a body read at once): the match keeps no state per line (a greedy group did: 100 bytes a byte).
    import tracemalloc

    tracemalloc.start()
    try:
        events = SseParser().feed(stream)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [(event.data, event.id) for event in events] == [("a", "1"), ("b", "1")]
    assert peak < len(stream), peak


field_values = st.text(st.characters(blacklist_characters="\r\n\0", blacklist_categories=("Cs",)), max_size=12)
# retry takes ASCII digits only (WHATWG); the reference's int() also takes "+5" or "1_0", so only digits are drawn.
lines = st.one_of(
    st.tuples(st.sampled_from(["data", "event", "id", "other"]), field_values).map(lambda p: f"{p[0]}: {p[1]}"),
    st.from_regex(r"\Aretry: [0-9]{1,6}\Z"),
    st.just(": comment"),
    st.just("data"),
    st.just(""),
)


@settings(max_examples=300, deadline=None)
@given(
    stream_lines=st.lists(lines, max_size=30),
    ends=st.lists(st.sampled_from(["\n", "\r\n", "\r"]), min_size=1, max_size=3),
    cuts=st.lists(st.integers(min_value=1, max_value=9), max_size=40),
)
def test_the_same_events_as_the_official_python_sdks_decoder(stream_lines, ends, cuts):
    from httpx2._sse import _SSEParser

    text = "".join(line + ends[n % len(ends)] for n, line in enumerate(stream_lines)) + "\n\n"
    raw = text.encode()
    ours: list[SseEvent] = []
    parser = SseParser()
    position = 0
    for cut in cuts:
        ours.extend(parser.feed(raw[position : position + cut]))
        position += cut
    ours.extend(parser.feed(raw[position:]))

    reference = _SSEParser()  # httpx2's, which mcp 2.x's client reads every event stream with
    theirs = [  # the one deliberate difference: a retry delay is bounded (sse.MAX_RETRY_MS)
        (event.data, event.event, event.id or None, None if event.retry is None else min(event.retry, sse.MAX_RETRY_MS))
        for event in [*reference.decode(text), *reference.flush()]
        if event.data
    ]
    assert [(e.data, e.event, e.id or None, e.retry_ms) for e in ours if e.data] == theirs


def test_an_event_of_many_short_data_lines_costs_about_its_size():
    import tracemalloc

    lines = b"data:a\n" * 1_000_000  # 7 MB, one event
    parser = SseParser()
    tracemalloc.start()
    try:
        for offset in range(0, len(lines), 65536):
            assert parser.feed(lines[offset : offset + 65536]) == []
        _, peak = tracemalloc.get_traced_memory()
        (event,) = parser.feed(b"\n")
    finally:
        tracemalloc.stop()
    assert event.data == "\n".join(["a"] * 1_000_000)
    assert peak < 3 * len(lines), peak  # held as bytes, not as a million str objects (~50 MB)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(b"500", 500), (b"30000", 30_000), (b"1000000000000", sse.MAX_RETRY_MS), (b"9" * 400, sse.MAX_RETRY_MS),
     (b"9" * 100_000, sse.MAX_RETRY_MS)],
)  # fmt: skip
def test_a_peers_retry_delay_is_bounded_whatever_its_length(value, expected):
    """A retry of 10^12 ms would park a reconnect for decades; 5,000 digits would make int() raise."""
    parser = sse.SseParser(1 << 20)
    position = sse.StreamPosition()
    assert list(position.messages(parser, b"retry: " + value + b'\ndata: {"a":1}\n\n')) == [{"a": 1}]
    assert position.retry_ms == expected


_FIELD_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n\x00"), max_size=20)


@settings(max_examples=300, deadline=None)
@given(
    data=st.text(st.characters(blacklist_categories=("Cs",)), max_size=200).map(lambda t: t.replace("\r\n", "\n")),
    event=st.one_of(st.none(), _FIELD_TEXT.filter(lambda t: t and not t.startswith(" "))),
    event_id=st.one_of(st.none(), _FIELD_TEXT.filter(lambda t: not t.startswith(" "))),
    retry_ms=st.one_of(st.none(), st.integers(0, sse.MAX_RETRY_MS)),
)
def test_what_the_encoder_writes_the_parser_reads_back(data, event, event_id, retry_ms):
    """The one encoder of the proxy's events (every stream it writes) against the parser it reads upstreams with:
    data with line ends of any kind, a name, an id and a delay come back as they went."""
    encoded = sse.event_bytes(data, event=event, event_id=event_id, retry_ms=retry_ms)
    (parsed,) = SseParser().feed(encoded)
    expected = data.replace("\r", "\n")
    assert parsed.data == expected and parsed.event == (event or "message")
    assert parsed.id == event_id and parsed.retry_ms == retry_ms


def test_a_message_event_is_one_data_line():
    assert sse.message_event({"jsonrpc": "2.0", "method": "x"}, event_id="7") == (
        b'event: message\nid: 7\ndata: {"jsonrpc":"2.0","method":"x"}\n\n'
    )
