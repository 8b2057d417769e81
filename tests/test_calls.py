"""The task-call HTTP client against scripted TCP servers on loopback: framing, reuse, faults, cancellation."""

from __future__ import annotations

import asyncio
import gzip
import re
import secrets
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from mcp_tasks_proxy.upstream.http.client import CallClient, CallError

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class ScriptedServer:
    """Answers each request on a connection with the script; records requests and connections."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []
        self.closed_by_client = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                body = await reader.readexactly(length)
                self.requests.append((head, body))
                await self.script(reader, writer)
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_client.set()
        finally:
            writer.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/mcp?x=1"


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Script], Awaitable[ScriptedServer]]]:
    servers: list[ScriptedServer] = []

    async def start(script: Script) -> ScriptedServer:
        scripted = ScriptedServer(script)
        scripted.server = await asyncio.start_server(scripted._handle, "127.0.0.1", 0)
        servers.append(scripted)
        return scripted

    yield start
    for scripted in servers:
        assert scripted.server is not None
        scripted.server.close()


def respond(raw: bytes, *, close: bool = False) -> Script:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(raw)
        await writer.drain()
        if close:
            writer.close()

    return script


JSON = b'{"jsonrpc":"2.0","id":1,"result":{}}'


async def test_a_request_goes_out_as_written_and_a_content_length_answer_is_read(serve) -> None:
    server = await serve(respond(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                                 % (len(JSON), JSON)))  # fmt: skip
    client = CallClient(server.url, connect_timeout_s=2)
    async with await client.post({"Authorization": "Bearer t", "Mcp-Method": "tools/call"}, b'{"a":1}') as response:
        assert response.status == 200
        assert response.content_type == "application/json"
        assert await response.read() == JSON
    head, body = server.requests[0]
    assert head.startswith(b"POST /mcp?x=1 HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"\r\nAuthorization: Bearer t\r\n" in head and b"\r\nMcp-Method: tools/call\r\n" in head
    assert body == b'{"a":1}'
    await client.aclose()


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\nX-Checksum: 1\r\nX-Other: 2\r\n\r\n",
    ],
    ids=["length", "chunked-with-trailers"],
)
async def test_a_finished_connection_is_reused_and_one_the_server_closes_is_not(serve, answer: bytes) -> None:
    kept = await serve(respond(answer))
    client = CallClient(kept.url, connect_timeout_s=2)
    for _ in range(3):
        async with await client.post({}, b"x") as response:
            assert await response.read() == b"{}"
            assert "x-checksum" not in response.headers  # trailer fields are counted, not kept
    assert kept.connections == 1
    closing = await serve(respond(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}"))
    client = CallClient(closing.url, connect_timeout_s=2)
    for _ in range(3):
        async with await client.post({}, b"x") as response:
            assert await response.read() == b"{}"
    assert closing.connections == 3


async def test_idle_connections_expire_before_the_usual_server_keep_alive(serve) -> None:
    server = await serve(respond(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"))
    client = CallClient(server.url, connect_timeout_s=2, idle_s=0.05)
    async with await client.post({}, b"x") as response:
        await response.read()
    await asyncio.sleep(0.1)
    async with await client.post({}, b"x") as response:
        await response.read()
    assert server.connections == 2


async def test_chunked_split_anywhere_and_gzip_are_decoded(serve) -> None:
    payload = b'{"jsonrpc":"2.0","id":1,"result":{"text":"' + secrets.token_hex(2500).encode() + b'"}}'
    packed = gzip.compress(payload)
    assert len(packed) > 1000  # three non-empty chunks: an empty one would end the body early
    chunked = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(part), part) for part in (packed[:7], packed[7:100], packed[100:]))
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Encoding: gzip\r\n\r\n"
    raw = head + chunked + b"0\r\nX: y\r\n\r\n"

    async def dribble(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for i in range(0, len(raw), 3):  # every boundary lands inside some token
            writer.write(raw[i : i + 3])
            await writer.drain()
            await asyncio.sleep(0)

    server = await serve(dribble)
    client = CallClient(server.url, connect_timeout_s=2)
    async with await client.post({}, b"x") as response:
        assert await response.read() == payload
    async with await client.post({}, b"x") as response:  # the chunked framing ended cleanly: reused
        assert await response.read() == payload
    assert server.connections == 1


async def test_a_body_delimited_by_close_and_a_deflate_body(serve) -> None:
    server = await serve(respond(b"HTTP/1.1 200 OK\r\nContent-Encoding: deflate\r\n\r\n" + zlib.compress(b"hello"),
                                 close=True))  # fmt: skip
    client = CallClient(server.url, connect_timeout_s=2)
    async with await client.post({}, b"x") as response:
        assert await response.read() == b"hello"


async def test_an_interim_100_continue_is_skipped(serve) -> None:
    server = await serve(respond(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok"))
    client = CallClient(server.url, connect_timeout_s=2)
    async with await client.post({}, b"x") as response:
        assert response.status == 201
        assert await response.read() == b"ok"


async def test_a_stream_is_read_as_it_arrives(serve) -> None:
    release = asyncio.Event()

    async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        writer.write(b"7\r\ndata: 1\r\n")
        await writer.drain()
        await release.wait()
        writer.write(b"7\r\ndata: 2\r\n0\r\n\r\n")
        await writer.drain()

    server = await serve(stream)
    client = CallClient(server.url, connect_timeout_s=2)
    async with await client.post({}, b"x") as response:
        assert response.content_type == "text/event-stream"
        chunks = response.iter_chunks()
        assert await anext(chunks) == b"data: 1"
        release.set()
        assert await anext(chunks) == b"data: 2"
        with pytest.raises(StopAsyncIteration):
            await anext(chunks)


async def test_closing_an_unfinished_response_closes_the_connection(serve) -> None:
    async def never_ends(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n: ping\n\n")
        await writer.drain()
        await reader.read()  # until the client goes away

    server = await serve(never_ends)
    client = CallClient(server.url, connect_timeout_s=2)
    response = await client.post({}, b"x")
    assert await anext(response.iter_chunks()) == b": ping\n\n"
    response.close()
    await asyncio.wait_for(server.closed_by_client.wait(), 5)
    assert client._reuse() is None


_BROKEN = [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "closed the connection before the response"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab", "closed the connection before the response"),
    (b"SSH-2.0-OpenSSH\r\n\r\n", "malformed HTTP response (Expected HTTP/"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", "malformed HTTP response (Invalid character in Content-Length"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "malformed HTTP response"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x1f\r\n", "Invalid character in chunk size"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1_0\r\n", "Invalid character in chunk size"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
     "Transfer-Encoding can't be present with Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nab", "Duplicate Content-Length"),
    (b"HTTP/1.1 200 OK\nContent-Length: 2\n\nok", "Missing expected CR"),
    (b"HTTP/1.1 200 OK\r\nX: a\r\n folded\r\nContent-Length: 0\r\n\r\n", "malformed HTTP response"),
    (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: upgrade\r\n\r\n", "switched protocols"),
    (b"HTTP/1.1 099 Odd\r\nContent-Length: 0\r\n\r\n", "status code 99"),
    (b"HTTP/1.1 200 OK\r\nContent-Encoding: br\r\n\r\n", "unsupported content-encoding"),
    (b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 4\r\n\r\nnope", "undecodable"),
    (b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 12\r\n\r\n" + gzip.compress(b"x" * 100)[:12],
     "compressed body ends before"),
    (b"HTTP/1.1 200 OK\r\n" + b"X: " + b"a" * 70_000, "response head exceeds 65536 bytes"),
    (b"HTTP/1.1 200 OK\r\n" + b"X: a\r\n" * 300 + b"\r\n", "more than 200 header fields"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n"
     + b"".join(b"X-T%d: %s\r\n" % (n, b"y" * 10_000) for n in range(10)) + b"\r\n",
     "trailer fields exceed 65536 bytes"),
    (b"", "closed the connection before the response"),
]  # fmt: skip


@pytest.mark.parametrize(("raw", "message"), _BROKEN, ids=[str(n) for n in range(len(_BROKEN))])
async def test_broken_answers_raise_a_call_error_naming_the_fault(serve, raw: bytes, message: str) -> None:
    server = await serve(respond(raw, close=True))
    client = CallClient(server.url, connect_timeout_s=2)
    with pytest.raises(CallError, match=re.escape(message)):
        async with await client.post({}, b"x") as response:
            await response.read()
    assert client._reuse() is None


async def test_a_read_limit_stops_a_body_that_is_too_long(serve) -> None:
    server = await serve(respond(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"a" * 100))
    client = CallClient(server.url, connect_timeout_s=2)
    with pytest.raises(CallError, match="longer than 10 bytes"):
        async with await client.post({}, b"x") as response:
            await response.read(limit=10)


async def test_a_large_body_is_read_whole_through_flow_control(serve) -> None:
    payload = bytes(range(256)) * 20_000  # 5 MB: reading pauses and resumes several times
    server = await serve(respond(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload)))
    client = CallClient(server.url, connect_timeout_s=2)
    async with await client.post({}, b"x") as response:
        chunks = [chunk async for chunk in response.iter_chunks()]
    assert b"".join(chunks) == payload
    assert server.connections == 1


async def test_refused_connections_and_unsendable_headers_are_call_errors() -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = CallClient(f"http://127.0.0.1:{port}/mcp", connect_timeout_s=2)
    with pytest.raises(CallError):
        await client.post({}, b"x")
    with pytest.raises(CallError, match="cannot be sent"):
        await client.post({"X-Evil": "a\r\nInjected: 1"}, b"x")
    with pytest.raises(ValueError, match="not an http"):
        CallClient("ftp://127.0.0.1/x", connect_timeout_s=1)


async def test_a_head_over_the_limit_is_refused_however_its_bytes_arrive(serve) -> None:
    head = b"HTTP/1.1 200 OK\r\n" + b"X-Big: " + b"a" * 70_000 + b"\r\nContent-Length: 0\r\n\r\n"

    async def one_write(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(head)
        await writer.drain()

    async def in_pieces(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for i in range(0, len(head), 1000):
            writer.write(head[i : i + 1000])
            await writer.drain()

    for script in (one_write, in_pieces):
        server = await serve(script)
        client = CallClient(server.url, connect_timeout_s=2)
        with pytest.raises(CallError, match="exceeds 65536 bytes"):
            await client.post({}, b"x")


@pytest.mark.parametrize("status", [204, 304])
async def test_no_body_for_204_and_304_even_with_a_content_length(serve, status: int) -> None:
    # Content-Length on these describes a representation, not a body (RFC 9110 §8.6): waiting for it would hang.
    server = await serve(respond(b"HTTP/1.1 %d X\r\nContent-Length: 5\r\n\r\n" % status))
    client = CallClient(server.url, connect_timeout_s=2)
    for _ in range(2):
        async with await client.post({}, b"x") as response:
            assert response.status == status
            assert await asyncio.wait_for(response.read(), 5) == b""
    assert server.connections == 1  # the framing was understood: the connection was reused


async def test_a_response_followed_by_bytes_nobody_asked_for_stands_but_is_not_reused(serve) -> None:
    server = await serve(respond(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 200 OK\r\n\r\nrogue"))
    client = CallClient(server.url, connect_timeout_s=2)
    async with await client.post({}, b"x") as response:
        assert await response.read() == b"ok"
    async with await client.post({}, b"x") as response:
        assert await response.read() == b"ok"
    assert server.connections == 2


async def test_a_gzip_bomb_costs_bounded_memory_and_ends_at_the_read_limit(serve) -> None:
    import tracemalloc

    bomb = gzip.compress(b"\0" * (200 * 1024 * 1024), compresslevel=9)  # ~200 KB that inflates to 200 MB
    assert len(bomb) < 300_000
    server = await serve(respond(b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%s"
                                 % (len(bomb), bomb)))  # fmt: skip
    client = CallClient(server.url, connect_timeout_s=2)
    tracemalloc.start()
    try:
        with pytest.raises(CallError, match="longer than 4194304 bytes"):
            async with await client.post({}, b"x") as response:
                await response.read(limit=4 * 1024 * 1024)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 20 * 1024 * 1024, peak  # the limit plus a few inflate slices, not 200 MB


async def test_a_long_compressed_stream_is_inflated_as_it_is_read(serve) -> None:
    # A streaming reader takes every byte of a body far larger than the buffer, without holding it all.
    import tracemalloc

    events = b"data: x\n\n" * (5 * 1024 * 1024)  # 45 MB of events
    bomb = gzip.compress(events)
    expected = len(events)
    del events
    server = await serve(respond(b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%s"
                                 % (len(bomb), bomb)))  # fmt: skip
    client = CallClient(server.url, connect_timeout_s=2)
    tracemalloc.start()
    total = 0
    try:
        async with await client.post({}, b"x") as response:
            async for chunk in response.iter_chunks():
                total += len(chunk)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert total == expected
    assert peak < 12 * 1024 * 1024, peak


async def test_bytes_after_the_end_of_a_compressed_body_are_an_error_not_a_buildup(serve) -> None:
    # zlib keeps whatever follows a stream's end and copies it at each call: unbounded memory and time if accepted.
    body = gzip.compress(JSON) + b"\0" * 100_000
    head = b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunks = b"".join(
        b"%x\r\n%s\r\n" % (len(body[i : i + 1000]), body[i : i + 1000]) for i in range(0, len(body), 1000)
    )
    server = await serve(respond(head + chunks + b"0\r\n\r\n"))
    client = CallClient(server.url, connect_timeout_s=2)
    with pytest.raises(CallError, match="bytes after the end of the compressed body"):
        async with await client.post({}, b"x") as response:
            await response.read(limit=1024 * 1024)


_ANSWERS = {
    "length": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(JSON), JSON),
    "chunked-trailers": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"2\r\n{}\r\n3\r\n[1]\r\n0\r\nX-T: 1\r\n\r\n",
    "gzip": b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%s"
    % (len(gzip.compress(JSON)), gzip.compress(JSON)),
    "stream-until-close": b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
    b"event: message\ndata: 1\n\n",
    "no-content": b"HTTP/1.1 204 No Content\r\nX-Why: done\r\n\r\n",
    "accepted-empty": b"HTTP/1.1 202 Accepted\r\nContent-Length: 0\r\n\r\n",
    "not-allowed": b"HTTP/1.1 405 Method Not Allowed\r\nAllow: POST\r\nContent-Length: 3\r\n\r\nno!",
}


@pytest.mark.parametrize("method", ["GET", "POST", "DELETE"])
@pytest.mark.parametrize("answer", list(_ANSWERS), ids=list(_ANSWERS))
async def test_the_lean_client_reads_what_aiohttp_s_client_reads(serve, method: str, answer: str) -> None:
    """The lean client is the only way to the MCP endpoint: for each answer it reads the status, headers and
    (decoded) body aiohttp's client reads from the same bytes, for each method it sends."""
    import aiohttp

    raw = _ANSWERS[answer]
    server = await serve(respond(raw, close=b"Connection: close" in raw))
    body = None if method != "POST" else b"{}"
    client = CallClient(server.url, connect_timeout_s=2)
    async with await client.request(method, {"Accept": "application/json, text/event-stream"}, body) as response:
        lean = (response.status, {k: v for k, v in response.headers.items()}, await response.read())
    await client.aclose()
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, server.url, data=body, skip_auto_headers=("Content-Type",)) as theirs,
    ):
        reference = (theirs.status, {k.lower(): v for k, v in theirs.headers.items()}, await theirs.read())
    assert lean == reference
    head = server.requests[0][0]
    assert head.startswith(b"%s /mcp?x=1 HTTP/1.1\r\n" % method.encode())
    assert (b"Content-Length:" in head) == (body is not None)


async def test_a_method_the_lean_client_does_not_send_is_a_call_error(serve) -> None:
    client = CallClient("http://127.0.0.1:9/mcp", connect_timeout_s=2)
    with pytest.raises(CallError, match="PUT is not a method"):
        await client.request("PUT", {}, b"")


async def test_a_get_or_delete_on_a_kept_connection_the_server_closed_is_sent_again_and_a_post_is_not(serve):
    """A server that closes a kept connection as the next request goes out: a GET or DELETE never reached it and
    is sent once more on a new connection, as aiohttp's client does; a POST may have, and is not."""
    served: dict[object, int] = {}

    async def first_only(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")  # one connection's, while it is open
        served[peer] = served.get(peer, 0) + 1
        if served[peer] == 2:
            writer.close()  # the second request on a connection: closed without a byte
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()

    server = await serve(first_only)
    client = CallClient(server.url, connect_timeout_s=2)
    for method in ("GET", "DELETE"):
        for _ in range(2):
            async with await client.request(method, {}, None) as response:
                assert response.status == 200 and await response.read() == b"{}"
    with pytest.raises(CallError, match="closed the connection"):
        await client.post({}, b"x")  # on the connection the last DELETE was answered on
    await client.aclose()


async def test_a_body_nobody_needs_is_read_when_short_and_never_waited_on(serve) -> None:
    from mcp_tasks_proxy.upstream.http.endpoint import finished

    endless = await serve(respond(b"HTTP/1.1 202 Accepted\r\nContent-Type: text/event-stream\r\n"
                                  b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"))  # fmt: skip
    client = CallClient(endless.url, connect_timeout_s=2)
    assert await asyncio.wait_for(finished(await client.post({}, b"{}")), 1) == 202  # closed, not waited on
    short = await serve(respond(b"HTTP/1.1 202 Accepted\r\nContent-Length: 2\r\n\r\nok"))
    client = CallClient(short.url, connect_timeout_s=2)
    for _ in range(3):
        assert await finished(await client.post({}, b"{}")) == 202
    assert short.connections == 1  # read to its end: the connection is kept
    await client.aclose()
