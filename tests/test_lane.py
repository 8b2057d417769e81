"""The pass-through lane (proxy/front/lane/): what it relays answers exactly as aiohttp's path does, and everything
else, on any connection, is handed to aiohttp with nothing lost.

Every other test that builds a proxy with `make_proxy` serves it as the command does, lane first: this file checks
what only the lane can get wrong (framing, hand-over, deadlines, pipelining, the connection cap)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import secrets
import socket
import time
import tracemalloc
from typing import Any

import httptools
import pytest
from aiohttp import web

from mcp_tasks_proxy.config import parse_config
from mcp_tasks_proxy.front import serve
from mcp_tasks_proxy.front.app import create_app
from mcp_tasks_proxy.front.context import metrics_key
from mcp_tasks_proxy.front.lane.writer import LaneWriter
from tests.conftest import eventually, task_reaches
from tests.factories import headers_for, meta, parse_body, request


def lane_counts(proxy: Any) -> dict[str, float]:
    """mcp_tasks_proxy_lane_total by outcome, read as a scrape would."""
    text = proxy.app[metrics_key].render().decode()
    return {m[0]: float(m[1]) for m in re.findall(r'mcp_tasks_proxy_lane_total\{outcome="(\w+)"\} (\S+)', text)}


def request_counts(proxy: Any) -> dict[tuple[str, str, str], float]:
    """mcp_tasks_proxy_requests_total by (method, mode, status), read as a scrape would."""
    text = proxy.app[metrics_key].render().decode()
    pattern = r'mcp_tasks_proxy_requests_total\{method="([^"]*)",mode="([^"]*)",status="(\d+)"\} (\S+)'
    return {(m[0], m[1], m[2]): float(m[3]) for m in re.findall(pattern, text)}


def counted(before: dict[Any, float], after: dict[Any, float]) -> dict[Any, float]:
    return {key: after[key] - before.get(key, 0) for key in after if after[key] != before.get(key, 0)}


def call(name: str, arguments: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return request("tools/call", {"name": name, "arguments": arguments, "_meta": meta(tasks=False), **extra})


async def raw_exchange(port: int, data: bytes, *, read_s: float = 5.0) -> bytes:
    """Write `data` on a new connection and read until the server closes it (or `read_s` passes)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    received = b""
    try:
        async with asyncio.timeout(read_s):
            while chunk := await reader.read(65536):
                received += chunk
    except TimeoutError:
        pass
    writer.close()
    return received


def port_of(proxy: Any) -> int:
    return int(proxy.url.rsplit(":", 1)[1].split("/")[0])


def http_post(message: dict[str, Any], *, extra: bytes = b"", body: bytes | None = None) -> bytes:
    """A POST of `message` (or of `body` under `message`'s headers) as a 2026 client writes it."""
    body = json.dumps(message).encode() if body is None else body
    head = "POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in headers_for(message).items())
    return head.encode() + extra + b"Content-Length: %d\r\n\r\n" % len(body) + body


def answers(raw: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """The HTTP/1.1 responses in `raw`, each framed by its Content-Length."""
    out = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        fields = dict(line.split(": ", 1) for line in lines[1:])
        length = int({k.lower(): v for k, v in fields.items()}["content-length"])
        out.append((int(lines[0].split()[1]), fields, rest[:length]))
        raw = rest[length:]
    return out


def aiohttp_path(body: bytes) -> dict[str, Any]:
    """What makes aiohttp's client send `body` on aiohttp's path: a request that expects 100-continue, which the
    lane hands to aiohttp (a chunked body no longer does: the lane reads those itself)."""
    return {"data": body, "expect100": True}


@pytest.fixture
async def proxy(make_proxy, mcp_upstream):
    return await make_proxy(
        mcp_upstream,
        protocol="modern",
        tools=[{"match": "slow_report", "task": "optional"}],
        listen={"body_timeout_s": 1, "header_timeout_s": 1},
    )


async def test_the_upstream_s_response_fields_are_relayed_as_the_bytes_received_without_hop_by_hop_ones(make_proxy):
    """The lane writes the upstream's end-to-end response fields back byte for byte (case, order, repeats, bytes
    that are not ASCII), without the hop-by-hop ones or those the upstream's Connection header names, and with one
    Date and one Server: the upstream's own, or the proxy's where the upstream sent none (or named its own in
    Connection)."""
    body = b'{"jsonrpc":"2.0","id":1,"result":{"resultType":"complete"}}'
    shapes = {
        b"own": b"Date: Thu, 01 Jan 2026 00:00:00 GMT\r\nServer: upstream/1\r\n",
        b"listed": b"Connection: keep-alive, Date, Server\r\nDate: Thu, 01 Jan 2026 00:00:00 GMT\r\n"
        b"Server: upstream/1\r\n",
    }

    writers: list[asyncio.StreamWriter] = []

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            await answer_each(reader, writer)
        writer.close()

    async def answer_each(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while head := await reader.readuntil(b"\r\n\r\n"):
            length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
            await reader.readexactly(length)
            shape = shapes[b"listed" if b"shape=listed" in head.split(b"\r\n")[0] else b"own"]
            writer.write(
                b"HTTP/1.1 200 Fine\r\ncontent-TYPE: application/json\r\nConnection: keep-alive, X-Resp-Hop\r\n"
                b"X-Resp-Hop: 1\r\nKeep-Alive: timeout=5\r\nX-Padded: a  b \t\r\nX-Latin: caf\xe9\r\n"
                b"Set-Cookie: a=1\r\nSet-Cookie: b=2\r\n" + shape + b"Content-Length: %d\r\n\r\n" % len(body) + body
            )
            await writer.drain()

    server = await asyncio.start_server(upstream, "127.0.0.1", 0)
    try:
        upstream_port = server.sockets[0].getsockname()[1]
        proxy = await make_proxy(f"http://127.0.0.1:{upstream_port}/mcp", protocol="modern")
        for shape in (b"own", b"listed"):
            before = lane_counts(proxy)
            raw = http_post({**call("quick", {}), "id": 1}, extra=b"Connection: close\r\n")  # the answer's id
            raw = raw.replace(b"POST /mcp ", b"POST /mcp?shape=" + shape + b" ", 1)
            received = await raw_exchange(port_of(proxy), raw)
            assert lane_counts(proxy)["relayed"] == before.get("relayed", 0) + 1
            head, _, rest = received.partition(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            assert lines[0] == b"HTTP/1.1 200 Fine" and rest == body
            fields = lines[1:]
            assert fields[:5] == [
                b"content-TYPE: application/json",
                b"X-Padded: a  b",
                b"X-Latin: caf\xe9",
                b"Set-Cookie: a=1",
                b"Set-Cookie: b=2",
            ]
            names = [field.split(b":", 1)[0].lower() for field in fields]
            assert b"x-resp-hop" not in names and b"keep-alive" not in names
            assert names.count(b"date") == names.count(b"server") == 1
            assert b"Content-Length: %d" % len(body) in fields and b"Connection: close" in fields
            upstream_own = b"Server: upstream/1" in fields and b"Date: Thu, 01 Jan 2026 00:00:00 GMT" in fields
            assert upstream_own == (shape == b"own")
    finally:
        server.close()
        for writer in writers:
            writer.close()
        await asyncio.gather(*(writer.wait_closed() for writer in writers), return_exceptions=True)


@pytest.mark.parametrize("depth", [400, 600])
@pytest.mark.parametrize("case", ["relayed", "bridged", "task"])
async def test_a_deeply_nested_request_the_proxy_encodes_again_gets_the_same_answer_on_both_paths(
    make_proxy, fake_upstream, legacy_upstream, mcp_upstream, case, depth
):
    """What the proxy encodes again (a relayed body without its tasks declaration, a call bridged to a 2025-era
    server, a task's call) past orjson's 254 levels is encoded by the standard library, within a bound of its own
    (jsonrpc.MAX_DUMPS_DEPTH): where it stops never depends on the path's stack, and past it both paths refuse the
    request before anything starts."""

    async def handler(request):
        from aiohttp import web

        body = json.loads(await request.read())
        return web.json_response({"jsonrpc": "2.0", "id": body["id"], "result": {"resultType": "complete"}})

    deep = json.loads("[" * depth + "]" * depth)
    if case == "relayed":
        fake = await fake_upstream(handler)
        proxy = await make_proxy(fake.url, protocol="modern")
        message = request("tools/list", {"_meta": meta(), "n": deep})
    elif case == "bridged":
        proxy = await make_proxy(legacy_upstream, protocol="legacy")
        message = request("tools/list", {"_meta": meta(), "n": deep})
    else:
        proxy = await make_proxy(mcp_upstream, protocol="modern", tools=[{"match": "slow_report", "task": "optional"}])
        message = request("tools/call", {"name": "slow_report", "arguments": {"topic": deep}, "_meta": meta()})
    lane = await proxy.client.send(message)
    async with proxy.client.session.post(
        proxy.url, **aiohttp_path(json.dumps(message).encode()), headers={**headers_for(message), "Connection": "close"}
    ) as response:
        on_aiohttp = (response.status, json.loads(await response.read()))
    on_lane = (lane.status, json.loads(lane.body))
    counts = lane_counts(proxy)
    if depth > 512:
        assert on_lane == on_aiohttp, case
        assert on_aiohttp[0] == 400 and on_aiohttp[1]["error"]["code"] == -32600, case
        assert "nested more than 512 levels deep" in on_aiohttp[1]["error"]["message"]
        assert counts.get("relayed", 0) == 0, case  # nothing sent upstream: refused by aiohttp, or the lane's own
        if case == "relayed":
            assert fake.received == []
        return
    assert counts.get("relayed", 0) + counts.get("served", 0) == 1, case  # taken by the lane, encoded there
    if case == "task":
        assert on_lane[0] == on_aiohttp[0] == 200
        assert on_lane[1]["result"]["resultType"] == on_aiohttp[1]["result"]["resultType"] == "task"
    else:  # relayed: the fake's answer; bridged: the 2025 SDK server's refusal of the unknown parameter
        assert on_lane == on_aiohttp, case
    if case == "relayed":
        sent_on_lane, sent_on_aiohttp = (sent["body"] for sent in fake.received)
        assert sent_on_lane == sent_on_aiohttp and b"io.modelcontextprotocol/tasks" not in sent_on_lane


async def test_a_connection_between_requests_holds_no_copy_of_the_last_request(proxy):
    """A served request's body chunks, header fields and URL are let go with the request: an idle kept-alive
    connection, or a bridged call parked after a take-over (which holds its connection), keeps no copy of them."""
    before = lane_counts(proxy)
    padding = {f"X-Pad-{i}": "v" * 300 for i in range(60)}  # 18 KB of head, within the lane's 32 KB
    reply = await proxy.client.send(call("add", {"a": 2, "b": 3, "padding": "x" * 8_000}), headers=padding)
    assert reply.status == 200
    assert lane_counts(proxy)["relayed"] == before.get("relayed", 0) + 1
    held = [
        sum(map(len, connection._body)) + sum(len(n) + len(v) for n, v in connection._fields) + len(connection._url)
        for connection in proxy.lane.connections
    ]
    assert held and max(held) == 0, held


async def _modern_upstream_holding_its_answer(release: asyncio.Event, sent: asyncio.Event, *, stream: bool):
    """A 2026 upstream that reads a call and holds its answer until `release`: an event stream whose head and one
    progress event come at once (`stream`), or one JSON answer, head and all, at the end."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            head = await reader.readuntil(b"\r\n\r\n")
            body = await reader.readexactly(int(re.search(rb"(?i)content-length: *(\d+)", head).group(1)))
            request_id = json.dumps(json.loads(body)["id"]).encode()
            del body
            result = b'{"jsonrpc":"2.0","id":%s,"result":{"resultType":"complete","content":[]}}' % request_id
            if stream:
                progress = b'data: {"jsonrpc":"2.0","method":"notifications/progress","params":{"progressToken":1,'
                progress += b'"progress":1}}\n\n'
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                )
                writer.write(b"%x\r\n%s\r\n" % (len(progress), progress))
                await writer.drain()
            sent.set()
            await release.wait()
            if stream:
                event = b"data: %s\n\n" % result
                writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(event), event))
            else:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(result), result))  # fmt: skip
            await writer.drain()
        writer.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0)


@pytest.mark.parametrize("era", ["modern-stream", "modern-json", "legacy"])
async def test_a_call_in_flight_holds_no_parsed_copy_of_its_request(make_proxy, legacy_upstream, era):
    """A relayed call (its answer a stream that lasts as long as the tool runs, or JSON that comes when it ends) or
    a call bridged to a 2025-era server keeps nothing of its request once it is sent upstream: not the body, not
    the message parsed from it (about ten times the body's size for arguments of many small values)."""
    release, sent = asyncio.Event(), asyncio.Event()
    server = None
    if era.startswith("modern"):
        server = await _modern_upstream_holding_its_answer(release, sent, stream=era == "modern-stream")
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/mcp"
        message = call("long", {"items": list(range(1_000_000, 1_060_000))})
    else:
        url = legacy_upstream
        message = call("quiet", {"seconds": 2, "items": list(range(1_000_000, 1_060_000))})
    proxy = await make_proxy(url, protocol=era.partition("-")[0])
    raw = http_post(message, extra=b"Connection: close\r\n")
    del message
    before = lane_counts(proxy)
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(proxy))
        writer.write(raw)
        await writer.drain()
        if era == "modern-stream":
            await asyncio.wait_for(sent.wait(), timeout=10)
            await asyncio.wait_for(reader.readuntil(b"\n\n"), timeout=10)  # the progress event: the call runs
        elif era == "modern-json":
            await asyncio.wait_for(sent.wait(), timeout=10)  # the upstream has the whole request, and holds its answer
            await asyncio.sleep(0.2)
        else:
            await asyncio.sleep(1)  # the call is sent and runs upstream for 2 s
        held = tracemalloc.get_traced_memory()[0] - baseline
    finally:
        tracemalloc.stop()
    release.set()
    answer = await asyncio.wait_for(reader.read(), timeout=10)
    writer.close()
    if server is not None:
        server.close()
    assert b'"resultType":"complete"' in answer.replace(b" ", b"")
    assert lane_counts(proxy)["relayed"] == before.get("relayed", 0) + 1
    assert len(raw) > 400_000 and held < 300_000, f"{held} bytes held while the call runs"


async def test_a_client_that_pipelines_and_never_reads_gets_no_more_answers_than_its_socket_holds(
    make_proxy, fake_upstream
):
    """Answers wait for the client to read them: what it pipelines meanwhile is not answered into the transport's
    buffer without end (aiohttp's path holds back the same way). Once it reads, every answer comes, in order."""
    big = "x" * 200_000

    async def answer(http: web.Request) -> web.Response:
        message = json.loads(await http.read())
        result = {"content": [{"type": "text", "text": big}], "n": message["params"]["arguments"]["n"]}
        return web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": result})

    fake = await fake_upstream(answer)
    proxy = await make_proxy(fake.url, protocol="modern")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: no autotuned megabytes
    sock.connect(("127.0.0.1", port_of(proxy)))
    reader, writer = await asyncio.open_connection(sock=sock, limit=2**20)
    writer.transport.pause_reading()  # the client reads nothing for now
    for n in range(60):
        writer.write(http_post(call("echo", {"n": n})))
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.5)
    (connection,) = proxy.lane.connections
    assert connection._transport.get_write_buffer_size() < 1_000_000  # before: 9 MB and growing with each request
    writer.transport.resume_reading()
    for n in range(60):
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
        length = int(re.search(rb"(?i)\r\ncontent-length: *(\d+)", head).group(1))
        assert json.loads(await reader.readexactly(length))["result"]["n"] == n
    writer.close()


async def test_a_pipelined_backlog_is_bounded_and_each_request_costs_the_same_however_much_waits(proxy, monkeypatch):
    """A client that pipelines megabytes on one connection: the lane holds about 64 KB of them unparsed (plus one
    read), and parses each byte about once, not the whole backlog again for every request (before: the proxy read
    38 MB of 40 and answered 207 requests in 22 s of CPU)."""
    from mcp_tasks_proxy.front.lane.connection import LaneConnection

    fed, held = [0], [0]
    feed, received = LaneConnection._feed, LaneConnection.data_received

    def counting_feed(self, data):
        fed[0] += len(data)
        return feed(self, data)

    def watching_received(self, data):
        received(self, data)
        held[0] = max(held[0], self.backlog.size)

    monkeypatch.setattr(LaneConnection, "_feed", counting_feed)
    monkeypatch.setattr(LaneConnection, "data_received", watching_received)
    one = http_post(request("tasks/get", {"taskId": "nope", "_meta": meta()}, id=1))
    count = 6_000
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(proxy))

    async def send() -> None:
        for _ in range(count // 100):
            writer.write(one * 100)
            await writer.drain()

    sending = asyncio.ensure_future(send())
    answered = 0
    async with asyncio.timeout(50):
        while answered < count:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(re.search(rb"(?i)\r\ncontent-length: *(\d+)", head).group(1))
            assert json.loads(await reader.readexactly(length))["error"]["code"] == -32602
            answered += 1
            assert fed[0] <= (len(one) + 4096) * count, f"{fed[0]} bytes parsed for {answered} answers"
    await sending
    writer.close()
    assert held[0] <= 64 * 1024 + 256 * 1024, f"{held[0]} bytes held unparsed"
    assert fed[0] <= (len(one) + 4096) * count


async def test_a_client_that_leaves_while_its_answers_wait_leaves_no_error_behind():
    """A writer paused by a client that then leaves: nothing waits on the pause, and asyncio has no exception of it
    to log ("Future exception was never retrieved")."""
    loop = asyncio.get_running_loop()
    reported: list[str] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: reported.append(context["message"]))
    try:
        writer = LaneWriter(None, loop, lambda: "")  # type: ignore[arg-type]
        writer.pause()
        writer.lost()
        assert not writer.paused
        with pytest.raises(ConnectionResetError):
            await writer.drain()
        del writer  # its pause future goes with it (no cycle): asyncio would report an unretrieved exception now
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
    assert reported == []


async def test_a_header_name_longer_than_aiohttp_reads_is_aiohttp_s_to_refuse(proxy):
    """aiohttp refuses a header name past 8,190 bytes (400): the lane hands such a request over rather than relay
    what aiohttp's path would refuse."""
    message = call("add", {"a": 1, "b": 1})
    long_name = b"X-" + b"n" * 9000 + b": 1\r\nConnection: close\r\n"
    [(status, _, _)] = answers(await raw_exchange(port_of(proxy), http_post(message, extra=long_name)))
    assert status == 400
    assert lane_counts(proxy).get("relayed", 0) == 0


@pytest.mark.parametrize(
    ("why", "message", "headers", "status", "code"),
    [
        ("routing header disagrees", call("add", {"a": 1, "b": 1}), {"Mcp-Name": "other"}, 400, -32020),
        ("owned method", request("tasks/get", {"taskId": "nope", "_meta": meta()}), {}, 400, -32602),
        ("Host not allowed", call("add", {"a": 1, "b": 1}), {"Host": "evil.example"}, 421, -32600),
    ],
)
async def test_what_the_lane_does_not_relay_is_answered_by_aiohttp_as_before(
    proxy, why, message, headers, status, code
):
    before = lane_counts(proxy).get("relayed", 0)
    reply = await proxy.client.send(message, headers=headers)
    assert reply.status == status, why
    assert reply.error["code"] == code, why
    assert lane_counts(proxy).get("relayed", 0) == before, why


async def test_a_task_rule_s_tool_is_not_relayed_by_the_lane(proxy):
    reply = await proxy.client.call_tool("slow_report", {"topic": "t", "seconds": 0.1}, tasks=True)
    assert reply.result["resultType"] == "task"
    assert lane_counts(proxy).get("relayed", 0) == 0


async def test_a_request_whose_body_is_not_ascii_is_relayed_on_the_lane(proxy):
    """The head's fields are checked one by one when the bytes read with them are not all ASCII (a UTF-8 body):
    plain ones still take the lane, as when the whole read is ASCII."""
    for text in ("caf\u00e9 \u2603", "plain"):
        before = lane_counts(proxy)
        message = call("add", {"a": 2, "b": 3}, note=text)
        body = json.dumps(message, ensure_ascii=False)
        assert body.isascii() == (text == "plain")
        reply = await proxy.client.post_raw(body, headers_for(message))
        assert reply.result["structuredContent"] == {"result": 5}
        assert lane_counts(proxy)["relayed"] == before.get("relayed", 0) + 1


async def test_a_small_head_with_a_large_body_in_one_write_takes_the_lane_and_an_endless_head_goes_to_aiohttp(proxy):
    """The lane's bound on a head counts the head only: a body that arrives in the same read as its head (a client
    writing the whole request at once) does not make the request aiohttp's. A head still unfinished past the bound
    is aiohttp's to refuse, with the bytes the lane read."""
    port = port_of(proxy)
    big = call("add", {"a": 2, "b": 3}, note="x" * 200_000)
    before = lane_counts(proxy)
    status, _, body = answers(await raw_exchange(port, http_post(big, extra=b"Connection: close\r\n")))[0]
    assert status == 200 and json.loads(body)["result"]["structuredContent"] == {"result": 5}
    after = lane_counts(proxy)
    assert after["relayed"] == before.get("relayed", 0) + 1
    assert after.get("handed_over", 0) == before.get("handed_over", 0)
    # 40 KB of header lines, the head unfinished: the connection is aiohttp's, which reads the rest of the request
    # from there and answers it.
    message = call("add", {"a": 4, "b": 5})
    whole = http_post(message, extra=b"".join(b"X-Pad-%d: %s\r\n" % (n, b"y" * 4000) for n in range(10)))
    cut = whole.index(b"X-Pad-9")
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(whole[:cut])
    await eventually(lambda: _async(lane_counts(proxy)["handed_over"] == after.get("handed_over", 0) + 1))
    writer.write(whole[cut:])
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
    length = int(re.search(rb"(?i)\r\ncontent-length: *(\d+)", head).group(1))
    answer = json.loads(await reader.readexactly(length))
    assert head.startswith(b"HTTP/1.1 200") and answer["result"]["structuredContent"] == {"result": 9}
    assert lane_counts(proxy)["relayed"] == after["relayed"]
    writer.close()


async def _async(value: Any) -> Any:
    return value


async def test_bytes_the_lane_will_not_read_go_to_aiohttp_whole(proxy):
    port = port_of(proxy)
    message = call("add", {"a": 1, "b": 2})
    # Not JSON; a body past limits.max_body_bytes; a header holding bytes that are not UTF-8.
    broken = http_post(message, body=json.dumps(message).encode()[:-1])
    status, _, body = answers(await raw_exchange(port, broken, read_s=1))[0]
    assert status == 400 and json.loads(body)["error"]["code"] == -32700
    big = call("add", {"a": 1, "b": 2, "pad": "x" * 5_000_000})
    status, _, body = answers(await raw_exchange(port, http_post(big), read_s=3))[0]
    assert status == 413 and b"limits.max_body_bytes" in body
    latin = http_post(message, extra=b"Mcp-Session-Id: caf\xe9\r\n")
    status, _, body = answers(await raw_exchange(port, latin, read_s=1))[0]
    assert status == 400 and b"Mcp-Session-Id" in body
    # A repeated Host (the guard must not judge only its first copy) or Content-Type: aiohttp refuses them.
    for repeated in (b"Host: evil.example\r\n", b"Content-Type: text/plain\r\n"):
        status, _, _ = answers(await raw_exchange(port, http_post(message, extra=repeated), read_s=1))[0]
        assert status == 400
    assert lane_counts(proxy).get("relayed", 0) == 0


async def test_one_connection_carries_relayed_and_handed_over_requests_in_order(proxy):
    port = port_of(proxy)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    got = []
    for a in range(3):  # three on the lane, kept alive
        writer.write(http_post(call("add", {"a": a, "b": 10})))
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(re.search(rb"Content-Length: (\d+)", head).group(1))
        got.append(json.loads(await reader.readexactly(length))["result"]["structuredContent"]["result"])
    writer.write(http_post(request("server/discover", {"_meta": meta()})))  # the proxy's: aiohttp answers it
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(re.search(rb"Content-Length: (\d+)", head).group(1))
    discovered = json.loads(await reader.readexactly(length))
    writer.write(http_post(call("add", {"a": 5, "b": 5})))  # and the lane reads the connection again
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(re.search(rb"Content-Length: (\d+)", head).group(1))
    last = json.loads(await reader.readexactly(length))
    writer.close()
    assert got == [10, 11, 12]
    assert "io.modelcontextprotocol/tasks" in discovered["result"]["capabilities"]["extensions"]
    assert last["result"]["structuredContent"]["result"] == 10
    assert lane_counts(proxy) == {"relayed": 4, "served": 0, "handled": 1, "handed_over": 0}


async def read_answers(reader: asyncio.StreamReader, count: int) -> list[Any]:
    """The JSON-RPC messages of the next `count` HTTP answers on a connection (the last event of a stream)."""

    class Answers:
        def __init__(self) -> None:
            self.bodies: list[bytes] = []
            self.body = b""

        def on_body(self, body: bytes) -> None:
            self.body += body

        def on_message_complete(self) -> None:
            self.bodies.append(self.body)
            self.body = b""

    answers_ = Answers()
    parser = httptools.HttpResponseParser(answers_)
    while len(answers_.bodies) < count:
        data = await asyncio.wait_for(reader.read(65536), 10)
        if not data:
            raise asyncio.IncompleteReadError(b"", None)  # the connection ended first
        parser.feed_data(data)
    out = []
    for body in answers_.bodies:
        text = body.decode()
        data = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
        out.append(json.loads(data[-1] if data else text))
    return out


async def test_pipelined_requests_are_answered_in_order_whatever_the_writes(proxy, upstream_client):
    port = port_of(proxy)
    one, two = call("add", {"a": 1, "b": 1}), call("add", {"a": 2, "b": 2})
    owned = request("tasks/get", {"taskId": "nope", "_meta": meta()})
    cases = [[one, two], [one, owned, two], [owned, one]]
    for messages in cases:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"".join(http_post(message) for message in messages))  # one write
        got = await read_answers(reader, len(messages))
        writer.close()
        assert [reply["id"] for reply in got] == [message["id"] for message in messages]
    # A second request cut across two writes, the first write ending the first request.
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = http_post(one) + http_post(two)
    cut = len(http_post(one)) + 7
    writer.write(data[:cut])
    await asyncio.sleep(0.2)
    writer.write(data[cut:])
    assert [reply["id"] for reply in await read_answers(reader, 2)] == [one["id"], two["id"]]
    writer.close()
    # Requests written while a slow call is answered wait for it, then are answered in order.
    gate = secrets.token_hex(6)
    slow = call("gated", {"tag": gate})
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(http_post(slow))
    await asyncio.sleep(0.3)
    writer.write(http_post(one))
    writer.write(http_post(owned))
    await asyncio.sleep(0.3)
    await upstream_client.call_tool("release", {"tag": gate}, tasks=False)
    got = await read_answers(reader, 3)
    writer.close()
    assert [reply["id"] for reply in got] == [slow["id"], one["id"], owned["id"]]
    assert got[0]["result"]["content"][0]["text"] == f"gate {gate} opened"
    assert got[1]["result"]["structuredContent"]["result"] == 2 and got[2]["error"]["code"] == -32602


async def test_a_late_body_gets_408_and_a_late_head_a_closed_connection(proxy):
    port = port_of(proxy)
    whole = http_post(call("add", {"a": 1, "b": 1}))
    started = asyncio.get_running_loop().time()
    status, fields, body = answers(await raw_exchange(port, whole[:-5], read_s=10))[0]
    assert status == 408 and b"listen.body_timeout_s" in body and fields.get("Connection") == "close"
    assert asyncio.get_running_loop().time() - started < 5  # 1 s, and the lane's sweep of a quarter second
    started = asyncio.get_running_loop().time()
    assert await raw_exchange(port, whole[:20], read_s=10) == b""
    assert asyncio.get_running_loop().time() - started < 5


async def test_the_connection_cap_counts_the_lane_s_connections(make_proxy, mcp_upstream):
    proxy = await make_proxy(mcp_upstream, protocol="modern", listen={"max_connections": 2})
    port = port_of(proxy)
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
    refused = await raw_exchange(port, http_post(call("add", {"a": 1, "b": 1})), read_s=3)
    assert refused.startswith(b"HTTP/1.1 503") and b"listen.max_connections" in refused
    for _, writer in held:
        writer.close()


async def test_a_connection_aiohttp_takes_over_after_the_application_answered_on_it_is_not_refused_by_the_cap(
    make_proxy, mcp_upstream
):
    proxy = await make_proxy(mcp_upstream, protocol="modern", listen={"max_connections": 2})
    port = port_of(proxy)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(http_post(request("tasks/get", {"taskId": "nope", "_meta": meta()})))  # the application's
    assert (await read_answers(reader, 1))[0]["error"]["code"] == -32602
    other = await asyncio.open_connection("127.0.0.1", port)  # the cap is reached
    message = call("add", {"a": 3, "b": 4})
    body = json.dumps(message).encode()
    writer.write(http_post(message, body=body).replace(b" HTTP/1.1\r\n", b" HTTP/1.0\r\n", 1))  # aiohttp's to read
    assert (await read_answers(reader, 1))[0]["result"]["structuredContent"]["result"] == 7
    assert lane_counts(proxy)["handed_over"] == 1
    writer.close()
    other[1].close()


async def test_a_client_that_leaves_mid_call_cancels_it_upstream(proxy, upstream_client):
    gate = secrets.token_hex(6)
    message = call("gated", {"tag": gate}, _meta={**meta(tasks=False), "progressToken": 1})
    port = port_of(proxy)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(http_post(message))
    head = await reader.readuntil(b"\r\n\r\n")  # the stream has begun: the call waits at its gate
    assert b"text/event-stream" in head and b"Transfer-Encoding: chunked" in head
    assert b"waiting at gate" in await reader.readuntil(b"\r\n\r\n")
    assert lane_counts(proxy)["relayed"] == 1
    writer.close()

    async def cancelled():
        state = await upstream_client.call_tool("gate_state", {"tag": gate}, tasks=False)
        return state.result["structuredContent"]["result"] == "cancelled"

    await eventually(cancelled, what="the upstream tool seeing the cancellation")


async def test_a_relayed_stream_arrives_event_by_event_and_ends_cleanly(proxy, upstream_client):
    gate = secrets.token_hex(6)
    message = call("gated", {"tag": gate}, _meta={**meta(tasks=False), "progressToken": "p"})
    async with proxy.client.session.post(proxy.url, json=message, headers=headers_for(message)) as response:
        first = b""
        while b"notifications/progress" not in first:  # before the call ends: nothing buffered to its end
            first += await response.content.readany()
        await upstream_client.call_tool("release", {"tag": gate}, tasks=False)
        rest = await response.content.read()
    assert f"gate {gate} opened".encode() in rest
    assert lane_counts(proxy)["relayed"] == 1


async def test_calls_bridged_to_a_2025_server_take_the_lane_with_their_input_rounds(make_proxy, legacy_upstream):
    proxy = await make_proxy(legacy_upstream, protocol="legacy")
    message = call("add", {"a": 2, "b": 40})
    lane = await proxy.client.send(message)
    assert lane.result["content"][0]["text"] == "42"
    # An MRTR round: the question as a JSON result, the retry's answer on an event stream (progress came first).
    meta_ = {**meta(tasks=False, elicitation={}), "progressToken": "p"}
    params = {"name": "ask_name", "arguments": {}, "_meta": meta_}
    first = await proxy.client.call("tools/call", params)
    (key,) = first.result["inputRequests"]
    answered = {key: {"action": "accept", "content": {"name": "Ada"}}}
    retry = {**params, "inputResponses": answered, "requestState": first.result["requestState"]}
    done = await proxy.client.call("tools/call", retry)
    assert done.headers["Content-Type"] == "text/event-stream"
    assert done.events[0]["method"] == "notifications/progress"
    assert done.result["content"][0]["text"] == "hello Ada"
    used = await proxy.client.call("tools/call", retry)  # the handle was single use: the bridge's own refusal
    assert used.status == 400 and used.error["code"] == -32602
    assert lane_counts(proxy) == {"relayed": 4, "served": 0, "handled": 0, "handed_over": 0}
    # The same call on aiohttp's path (a request that expects 100-continue is handed over) answers the same.
    body = json.dumps(message).encode()
    async with proxy.client.session.post(proxy.url, **aiohttp_path(body), headers=headers_for(message)) as response:
        assert response.status == lane.status == 200
        assert response.headers["Content-Type"] == lane.headers["Content-Type"]
        assert json.loads(await response.read()) == json.loads(lane.body)
    assert lane_counts(proxy) == {"relayed": 4, "served": 0, "handled": 0, "handed_over": 1}


async def test_a_question_on_the_standalone_stream_is_answered_by_the_task_that_brings_it(make_proxy, legacy_upstream):
    """The lane reads a bridged call in the request's own task. A question for it on the session's standalone stream
    (roots/list with no related request) comes while that task waits on the call's own stream: the task that brings
    it answers the client, the client makes another call meanwhile, the retry finishes the call, and each request is
    counted once, with its status."""
    proxy = await make_proxy(legacy_upstream, protocol="legacy")
    before = request_counts(proxy)
    params = {"name": "ask_roots_standalone", "arguments": {}, "_meta": meta(tasks=False, roots={})}
    first = await asyncio.wait_for(proxy.client.call("tools/call", params), timeout=30)
    ((key, question),) = first.result["inputRequests"].items()
    assert question["method"] == "roots/list"
    added = await proxy.client.send(call("add", {"a": 1, "b": 2}))
    assert added.result["content"][0]["text"] == "3"
    roots = {"roots": [{"uri": "file:///srv/project", "name": "project"}]}
    retry = {**params, "inputResponses": {key: roots}, "requestState": first.result["requestState"]}
    done = await asyncio.wait_for(proxy.client.call("tools/call", retry), timeout=30)
    assert done.result["content"][0]["text"] == "file:///srv/project"
    assert counted(before, request_counts(proxy)) == {("tools/call", "legacy", "200"): 3}
    assert lane_counts(proxy)["relayed"] == 3


async def test_a_client_that_opens_with_discover_and_polls_tasks_stays_on_the_lane(proxy):
    """An SDK client's first request (server/discover) is answered by aiohttp on the lane's connection; the task it
    creates and its polls are served by the lane itself, and the calls between are relayed there."""
    discovered = await proxy.client.call("server/discover")
    assert discovered.result["capabilities"]["extensions"] == {"io.modelcontextprotocol/tasks": {}}
    created = await proxy.client.call_tool("slow_report", {"topic": "t", "seconds": 0.1}, tasks=True)
    task_id = created.result["taskId"]
    for a in range(3):
        reply = await proxy.client.send(call("add", {"a": a, "b": 1}))
        assert reply.result["structuredContent"]["result"] == a + 1
        polled = await proxy.client.get_task(task_id)
        assert polled.result["taskId"] == task_id
    assert lane_counts(proxy) == {"relayed": 3, "served": 4, "handled": 1, "handed_over": 0}
    done = await task_reaches(proxy.client, task_id, "completed")
    assert done.result["result"]["content"]


async def test_the_lane_reads_every_post_to_the_mcp_endpoint_and_hands_aiohttp_the_connection_of_a_get(proxy):
    """However many POSTs in a row the lane leaves to the application's handler, it reads them (no hand-over, no
    re-parse of the answer); a GET gives aiohttp the connection for good, and aiohttp answers what follows on it."""
    port = port_of(proxy)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for _ in range(12):
        writer.write(http_post(request("server/discover", {"_meta": meta()})))
        (discovered,) = await read_answers(reader, 1)
        assert "io.modelcontextprotocol/tasks" in discovered["result"]["capabilities"]["extensions"]
    assert lane_counts(proxy) == {"relayed": 0, "served": 0, "handled": 12, "handed_over": 0}
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert (await read_answers(reader, 1)) == [{"status": "ok"}]
    writer.write(http_post(call("add", {"a": 1, "b": 2})))  # aiohttp's reader now: the same answer
    assert (await read_answers(reader, 1))[0]["result"]["structuredContent"]["result"] == 3
    writer.close()
    assert lane_counts(proxy) == {"relayed": 0, "served": 0, "handled": 12, "handed_over": 1}


def _owned_requests(task_id: str) -> list[tuple[str, dict[str, Any], dict[str, str]]]:
    """Requests the lane answers itself (the proxy's), each with the headers it is sent with."""
    arguments = {"topic": "t", "seconds": 0.1}
    create = request("tools/call", {"name": "slow_report", "arguments": arguments, "_meta": meta()})
    bad_arguments = request("tools/call", {"name": "slow_report", "arguments": [1], "_meta": meta()})
    future = request("tools/call", {"name": "slow_report", "arguments": arguments, "_meta": meta(version="2099-01-01")})
    return [
        ("tasks/get of the task", request("tasks/get", {"taskId": task_id, "_meta": meta()}), {}),
        ("tasks/get of no task", request("tasks/get", {"taskId": "nope", "_meta": meta()}), {}),
        ("tasks/get without the extension", request("tasks/get", {"taskId": task_id, "_meta": meta(tasks=False)}), {}),
        ("tasks/get, another caller", request("tasks/get", {"taskId": task_id, "_meta": meta()}),
         {"Authorization": "Bearer someone-else"}),
        ("tasks/update, bad params", request("tasks/update", {"taskId": task_id, "inputResponses": 1, "_meta": meta()}),
         {}),
        ("tasks/cancel of no task", request("tasks/cancel", {"taskId": "nope", "_meta": meta()}), {}),
        ("creation, header disagrees", create, {"Mcp-Name": "add"}),
        ("creation, bad arguments", bad_arguments, {}),
        ("creation, unsupported version", future, {"MCP-Protocol-Version": "2099-01-01"}),
        ("creation", create, {}),
    ]  # fmt: skip


async def test_the_proxy_s_own_requests_are_served_on_the_lane_with_the_answers_aiohttp_gives(make_proxy, mcp_upstream):
    """tasks/* and task creation: the lane's answer (status, type, body) is aiohttp's path's, request for request
    (a request that expects 100-continue is handed to aiohttp)."""
    proxy = await make_proxy(
        mcp_upstream,
        protocol="modern",
        tools=[{"match": "slow_report", "task": "optional"}],
        security={"principal": "authorization"},
    )
    me = {"Authorization": "Bearer me"}
    created = await proxy.client.call_tool("slow_report", {"topic": "t", "seconds": 0.1}, headers=me)
    task_id = created.result["taskId"]
    await task_reaches(proxy.client, task_id, "completed", headers=me)
    for why, message, headers in _owned_requests(task_id):
        # Connection: close: the connection handed to aiohttp is not the next request's.
        sent = {**headers_for(message), **me, **headers, "Connection": "close"}
        before, requests_before = lane_counts(proxy), request_counts(proxy)
        lane = await proxy.client.send(message, headers={**me, **headers})
        after, requests_lane = lane_counts(proxy), request_counts(proxy)
        async with proxy.client.session.post(
            proxy.url, **aiohttp_path(json.dumps(message).encode()), headers=sent
        ) as response:
            theirs, status, content_type = await response.json(), response.status, response.headers["Content-Type"]
        assert (lane.status, lane.headers["Content-Type"]) == (status, content_type), why
        # The same metric labels (method, mode, status) on either path: a refusal is not counted as a task.
        assert counted(requests_before, requests_lane) == counted(requests_lane, request_counts(proxy)), why
        ours = json.loads(lane.body)
        if why == "creation":  # two tasks: the same answer but for the task's id and times
            assert ours["result"]["resultType"] == theirs["result"]["resultType"] == "task"
            assert ours["result"]["status"] == theirs["result"]["status"] == "working"
            assert ours["result"]["taskId"] != theirs["result"]["taskId"]
        else:
            assert ours == theirs, why
        if why == "creation, header disagrees":
            # The body names another tool than the header: aiohttp's to refuse, on the lane's connection.
            assert (after["served"], after["handled"]) == (before["served"], before["handled"] + 1), why
        else:
            assert after["served"] == before.get("served", 0) + 1, why
    assert lane_counts(proxy)["handed_over"] == len(_owned_requests(task_id))


async def test_an_idempotent_creation_on_the_lane_names_the_same_task(proxy):
    params = {"name": "slow_report", "arguments": {"topic": "t", "seconds": 0.1}, "_meta": meta()}
    key = {"Idempotency-Key": "k-1"}
    first = await proxy.client.call("tools/call", params, headers=key)
    again = await proxy.client.call("tools/call", params, headers=key)
    assert first.result["taskId"] == again.result["taskId"]
    assert lane_counts(proxy)["served"] == 2


async def test_working_tasks_made_on_the_lane_share_the_names_of_the_headers_they_keep(proxy):
    """Ten thousand working tasks each keep the headers their upstream calls pass on: the lane decodes a header name
    once, for every request that sends it (as aiohttp does for the names it knows), not once per task."""
    from mcp_tasks_proxy.front.context import runner_key

    params = {"name": "slow_report", "arguments": {"topic": "t", "seconds": 5}, "_meta": meta()}
    created = [await proxy.client.call("tools/call", params, headers={"X-Tenant": "a"}) for _ in range(2)]
    assert lane_counts(proxy)["served"] == 2
    jobs = proxy.app[runner_key]._state.jobs
    first, second = (jobs[reply.result["taskId"]].call.headers for reply in created)
    kept = {name.lower(): name for name in first}
    assert {"x-tenant", "mcp-method", "mcp-protocol-version"} <= set(kept)
    for name in second:
        assert name is kept[name.lower()], name
    for reply in created:
        await proxy.client.call("tasks/cancel", {"taskId": reply.result["taskId"], "_meta": meta()})


@pytest.mark.parametrize("spaces", [" ", "\t", " \t "])
async def test_trailing_whitespace_in_a_header_does_not_change_the_caller_on_the_lane(make_proxy, mcp_upstream, spaces):
    """llhttp keeps a value's trailing spaces, aiohttp strips them: `Bearer me ` is the caller `Bearer me` on both
    paths, whichever of them created the task and whichever polls it."""
    proxy = await make_proxy(
        mcp_upstream,
        protocol="modern",
        tools=[{"match": "slow_report", "task": "optional"}],
        security={"principal": "authorization"},
    )
    arguments = {"topic": "t", "seconds": 0.1}
    create = request("tools/call", {"name": "slow_report", "arguments": arguments, "_meta": meta()})
    padded = f"Authorization: Bearer me{spaces}\r\nConnection: close\r\n".encode()
    [(status, _, body)] = answers(await raw_exchange(port_of(proxy), http_post(create, extra=padded)))
    assert status == 200
    on_lane = json.loads(body)["result"]["taskId"]
    assert lane_counts(proxy)["served"] == 1
    async with proxy.client.session.post(
        proxy.url,
        **aiohttp_path(json.dumps(create).encode()),
        headers={**headers_for(create), "Authorization": f"Bearer me{spaces}", "Connection": "close"},
    ) as response:
        on_aiohttp = (await response.json())["result"]["taskId"]
    for task_id in (on_lane, on_aiohttp):
        get = request("tasks/get", {"taskId": task_id, "_meta": meta()})
        for headers in ({"Authorization": "Bearer me"}, {"Authorization": f"Bearer me{spaces}"}):
            polled = await proxy.client.send(get, headers=headers)  # the lane
            assert json.loads(polled.body)["result"]["taskId"] == task_id, (task_id, headers)
            async with proxy.client.session.post(
                proxy.url,
                **aiohttp_path(json.dumps(get).encode()),
                headers={**headers_for(get), **headers, "Connection": "close"},  # not the lane's next connection
            ) as response:  # aiohttp's path
                assert (await response.json())["result"]["taskId"] == task_id, (task_id, headers)
        stranger = await proxy.client.send(get, headers={"Authorization": "Bearer you "})
        assert "error" in json.loads(stranger.body)
    assert lane_counts(proxy)["served"] == 1 + 2 * 3  # the creation, then each task's two polls and the stranger's


async def test_a_stop_gives_calls_on_the_lane_and_on_aiohttp_one_budget_not_two(fake_upstream, monkeypatch):
    """A call in flight on the lane and one on aiohttp's path when the proxy stops: the lane's wait runs beside
    aiohttp's, and aiohttp's two waits share the budget, so the stop takes SHUTDOWN_TIMEOUT_S, not three of it."""
    release = asyncio.Event()

    async def hang(http: web.Request) -> web.Response:
        await http.read()
        await release.wait()
        return web.Response()

    fake = await fake_upstream(hang)
    monkeypatch.setattr(serve, "SHUTDOWN_TIMEOUT_S", 2)
    config = parse_config({"upstream": {"url": fake.url, "protocol": "modern"}, "tasks": {"shutdown_grace_s": 0}})
    app = create_app(config)
    sock = serve.bind("127.0.0.1", 0)
    runner, lane = await serve.start(app, sock, config.listen, on_refused=lambda: None)
    port = sock.getsockname()[1]
    message = call("hang", {})
    body = json.dumps(message).encode()
    try:
        _, on_lane = await asyncio.open_connection("127.0.0.1", port)
        on_lane.write(http_post(message))
        _, on_aiohttp = await asyncio.open_connection("127.0.0.1", port)  # HTTP/1.0 is aiohttp's to read
        on_aiohttp.write(http_post(message, body=body).replace(b" HTTP/1.1\r\n", b" HTTP/1.0\r\n", 1))

        async def both_upstream() -> bool:
            return len(fake.received) == 2

        await eventually(both_upstream, what="both calls upstream")
        started = time.monotonic()
        await runner.cleanup()
        assert time.monotonic() - started < 3.5  # before: 2 s for the lane, then 2 x 2 s for aiohttp
        on_lane.close()
        on_aiohttp.close()
    finally:
        release.set()


def chunked_post(message: dict[str, Any], *, path: bytes = b"/mcp", trailer: bytes = b"") -> bytes:
    """A POST of `message` with a chunked body in two chunks, and `trailer` fields after the last one."""
    body = json.dumps(message).encode()
    head = http_post(message, body=b"").replace(b"Content-Length: 0\r\n", b"Transfer-Encoding: chunked\r\n")
    head = head.replace(b"POST /mcp ", b"POST " + path + b" ", 1)
    half = len(body) // 2
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:half], body[half:]))
    return head + chunks + b"0\r\n" + trailer + b"\r\n"


@pytest.mark.parametrize("first", ["tasks/get", "tools/call", "subscriptions/listen"])
async def test_a_chunked_body_s_trailer_never_becomes_the_next_request_s_header(proxy, first):
    """A front proxy that forwards trailers and pools connections puts caller A's chunked request and caller B's
    next one on the same connection: A's trailer field must not be read as B's header (aiohttp's parser made it B's
    first header, and the proxy reads the first Authorization: B's tasks/get answered A's task)."""
    alice, bob = {"Authorization": "Bearer alice"}, {"Authorization": "Bearer bob"}
    created = await proxy.client.call_tool("slow_report", {"topic": "t", "seconds": 30}, headers=alice)
    task_id = created.result["taskId"]
    get = request("tasks/get", {"taskId": task_id, "_meta": meta()})
    assert (await proxy.client.send(get, headers=bob)).error["code"] == -32602  # not bob's
    firsts = {
        "tasks/get": get,
        "tools/call": call("add", {"a": 1, "b": 2}),
        "subscriptions/listen": request("subscriptions/listen", {"notifications": {}, "_meta": meta()}),
    }
    a = chunked_post(firsts[first], trailer=b"Authorization: Bearer alice\r\n")
    b = http_post(get, extra=b"Authorization: Bearer bob\r\n")
    if first != "subscriptions/listen":  # (a stream that lasts: nothing follows it on its connection)
        # As a pooling front proxy sends them: B once A is answered, on the same connection.
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(proxy))
        writer.write(a)
        await read_answers(reader, 1)
        writer.write(b)
        (for_bob,) = await read_answers(reader, 1)
        writer.close()
        assert for_bob["error"]["code"] == -32602, for_bob  # bob's: not found, never alice's task
    # Pipelined behind A: B is answered as bob's, or not at all (the connection ends after A). Alice's credential
    # is in A's trailer alone, so nothing on this connection may show her task's state.
    received = await raw_exchange(port_of(proxy), a + b, read_s=3)
    assert received.startswith(b"HTTP/1.1 ") and b'"working"' not in received, received


async def test_a_chunked_body_to_another_path_leaves_the_connection_after_its_answer(proxy):
    """A chunked request the lane does not read (another path) is aiohttp's: its connection ends after it, so no
    trailer of it can reach a later request on that connection."""
    alice = {"Authorization": "Bearer alice"}
    created = await proxy.client.call_tool("slow_report", {"topic": "t", "seconds": 30}, headers=alice)
    get = request("tasks/get", {"taskId": created.result["taskId"], "_meta": meta()})
    a = chunked_post(call("add", {"a": 1, "b": 2}), path=b"/elsewhere", trailer=b"Authorization: Bearer alice\r\n")
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(proxy))
    writer.write(a)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert b"connection: close" in head.lower(), head
    writer.write(http_post(get, extra=b"Authorization: Bearer bob\r\n"))
    rest = await asyncio.wait_for(reader.read(), 10)  # to the end: the connection closes
    writer.close()
    assert b'"working"' not in rest and created.result["taskId"].encode() not in rest.split(b"\r\n\r\n", 1)[-1]


async def test_on_a_connection_aiohttp_took_a_chunked_request_s_trailer_reaches_no_later_request(proxy):
    alice = {"Authorization": "Bearer alice"}
    created = await proxy.client.call_tool("slow_report", {"topic": "t", "seconds": 30}, headers=alice)
    get = request("tasks/get", {"taskId": created.result["taskId"], "_meta": meta()})
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(proxy))
    for _ in range(12):  # requests the lane leaves to aiohttp: it hands aiohttp the connection for good
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        await read_answers(reader, 1)
    assert lane_counts(proxy)["handed_over"] == 1
    writer.write(chunked_post(get, trailer=b"Authorization: Bearer alice\r\n"))
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert b"connection: close" in head.lower(), head
    writer.write(http_post(get, extra=b"Authorization: Bearer bob\r\n"))
    rest = await asyncio.wait_for(reader.read(), 10)  # to the end: the connection closes
    writer.close()
    assert b'"working"' not in rest


async def test_a_chunked_call_is_read_on_the_lane_and_relayed_without_its_trailer(make_proxy, fake_upstream):
    seen: list[dict[str, str]] = []

    async def answer(http: web.Request) -> web.Response:
        seen.append(dict(http.headers))
        message = json.loads(await http.read())
        return web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": {"content": []}})

    fake = await fake_upstream(answer)
    proxy = await make_proxy(fake.url, protocol="modern", limits={"max_body_bytes": 4096})
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(proxy))
    message = call("echo", {"text": "x" * 100})
    writer.write(chunked_post(message, trailer=b"X-Trailing: 1\r\n"))
    (answer_,) = await read_answers(reader, 1)
    assert answer_["id"] == message["id"] and lane_counts(proxy)["relayed"] == 1
    assert "X-Trailing" not in seen[0] and "Transfer-Encoding" not in seen[0]
    # Past limits.max_body_bytes: 413, as for a Content-Length past it, and the connection ends.
    writer.write(chunked_post(call("echo", {"text": "x" * 5000})))
    received = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    (status, fields, body) = answers(received)[0]
    assert status == 413 and json.loads(body)["error"]["data"] == {"maxBodyBytes": 4096}
    assert len(seen) == 1


async def test_with_replicas_routing_sessions_the_lane_serves_what_names_no_session(
    make_proxy, mcp_upstream, redis_url
):
    """listen.advertise_url moves no traffic onto other code: a 2026 request is the lane's as without it; only what
    may name a 2025 session or a parked call (routed to the replica that holds it) is aiohttp's."""
    store = {"backend": "redis", "url": redis_url, "key_prefix": f"lane-{secrets.token_hex(4)}:"}
    proxy = await make_proxy(
        mcp_upstream,
        protocol="modern",
        store=store,
        tools=[{"match": "slow_report", "task": "optional"}],
        listen={"advertise_url": "http://127.0.0.1:1/"},
    )
    assert (await proxy.client.call_tool("add", {"a": 1, "b": 2}, tasks=False)).result["structuredContent"]
    created = await proxy.client.call_tool("slow_report", {"topic": "t", "seconds": 0})
    await task_reaches(proxy.client, created.result["taskId"], "completed")
    counts = lane_counts(proxy)
    assert counts["relayed"] == 1 and counts["served"] >= 2 and counts["handled"] == 0, counts
    parked = call("add", {"a": 1, "b": 2}, requestState="mtp1.somewhere~x.y", inputResponses={})
    await proxy.client.send(parked)
    await proxy.client.call_tool("add", {"a": 1, "b": 2}, tasks=False, headers={"Mcp-Session-Id": "s"})
    assert lane_counts(proxy)["handled"] == 2


async def test_a_2025_client_s_requests_the_proxy_does_not_own_are_relayed_on_the_lane(
    make_proxy, mcp_upstream, legacy_upstream
):
    """A 2025-era client's requests (no 2026 routing header) go to an HTTP upstream of either era as they are,
    read and relayed by the lane, with the answer aiohttp's path gives; what the proxy may own (SEP-1686 while a
    rule runs a tool as a task, server/discover, notifications and responses) is still aiohttp's."""
    headers_2025 = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    for upstream, protocol in ((mcp_upstream, "modern"), (legacy_upstream, "legacy")):
        proxy = await make_proxy(upstream, protocol=protocol)
        initialize = request("initialize", {"protocolVersion": "2025-11-25", "capabilities": {},
                                            "clientInfo": {"name": "t", "version": "0"}})  # fmt: skip
        first = await proxy.client.post_raw(json.dumps(initialize), headers_2025)
        assert first.status == 200 and first.message["result"]["protocolVersion"], first.message
        session = {**headers_2025, "MCP-Protocol-Version": first.message["result"]["protocolVersion"]}
        if "Mcp-Session-Id" in first.headers:
            session["Mcp-Session-Id"] = first.headers["Mcp-Session-Id"]
        listed = request("tools/list", {})
        on_lane = await proxy.client.post_raw(json.dumps(listed), session)
        assert on_lane.status == 200 and on_lane.message["result"]["tools"], on_lane.message
        # In front of a 2026 server the first 2025 request is aiohttp's: the proxy learns whether the server takes
        # 2025 clients as they are (else they are translated, clients/translated2025.py), and then the lane relays.
        learnt = 1 if protocol == "modern" else 0
        assert lane_counts(proxy) == {"relayed": 2 - learnt, "served": 0, "handled": learnt, "handed_over": 0}
        # aiohttp's path (a request that expects 100-continue is handed to it) answers the same.
        async with proxy.client.session.post(proxy.url, **aiohttp_path(json.dumps(listed).encode()),
                                             headers={**session, "Connection": "close"}) as response:  # fmt: skip
            theirs, _ = parse_body(response.headers.get("Content-Type", ""), await response.read())
            assert response.status == on_lane.status and theirs == on_lane.message
    # While a rule runs a tool as a task, what SEP-1686 may make the proxy's is aiohttp's to answer.
    proxy = await make_proxy(mcp_upstream, protocol="modern", tools=[{"match": "slow_report"}])
    initialize = request("initialize", {"protocolVersion": "2025-11-25", "capabilities": {},
                                        "clientInfo": {"name": "t", "version": "0"}})  # fmt: skip
    first = await proxy.client.post_raw(json.dumps(initialize), headers_2025)
    assert first.status == 200 and first.message["result"]["capabilities"]["tasks"], first.message  # the proxy's
    assert lane_counts(proxy)["handled"] == 1 and lane_counts(proxy)["relayed"] == 0


async def test_a_chunked_request_left_to_aiohttp_keeps_its_method_with_a_request_pipelined_behind_it(
    make_proxy, fake_upstream
):
    """The lane reads a chunked body and re-frames it for aiohttp; a request pipelined behind it in the same read
    starts a new parse, which must not change what the first one was (a fresh parser's method is DELETE)."""
    seen: list[str] = []

    async def answer(http: web.Request) -> web.Response:
        message = json.loads(await http.read()) if http.body_exists else {"id": None}
        if message.get("id") != "mtp-initialize":  # (the proxy's own: does the server take 2025 clients?)
            seen.append(http.method)
        return web.json_response({"jsonrpc": "2.0", "id": message.get("id"), "result": {"tools": []}})

    fake = await fake_upstream(answer)
    # A task rule: a 2025 client's tools/list may be SEP-1686's, so the lane leaves it to aiohttp.
    proxy = await make_proxy(fake.url, protocol="modern", tools=[{"match": "slow_*"}])
    listed = request("tools/list", {})
    a = chunked_post(listed).replace(b"MCP-Protocol-Version: 2026-07-28\r\n", b"MCP-Protocol-Version: 2025-06-18\r\n")
    a = a.replace(b"Mcp-Method: tools/list\r\n", b"")
    received = await raw_exchange(port_of(proxy), a + b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    (status, fields, body) = answers(received)[0]
    assert status == 200 and json.loads(body)["id"] == listed["id"] and seen == ["POST"], (seen, received)
    assert lane_counts(proxy)["handled"] == 1


async def test_an_answer_the_application_gives_says_the_connection_ends_when_the_lane_ends_it(proxy):
    """A chunked request with another pipelined behind it in the same write: what follows cannot be told apart, so
    the lane answers the first and ends the connection. The answer says so, whoever makes it (the lane's relay, or
    the application's handler, here for server/discover)."""
    discover = request("server/discover", {"_meta": meta()})
    body = json.dumps(discover).encode()
    chunked = http_post(
        discover, extra=b"Transfer-Encoding: chunked\r\n", body=b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    )
    chunked = chunked.replace(b"Content-Length: %d\r\n" % (len(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))), b"")
    raw = await raw_exchange(port_of(proxy), chunked + http_post(call("add", {"a": 1, "b": 2})))
    head = raw.partition(b"\r\n\r\n")[0].lower()
    assert head.startswith(b"http/1.1 200"), raw[:200]
    assert b"connection: close" in head, head


@pytest.mark.parametrize(
    "framing",
    [
        b"1;" + b"e" * 400_000 + b"\r\nx\r\n0\r\n\r\n",
        b"2\r\nab\r\n" * 60_000 + b"0\r\n\r\n",
        b"1\r\nx\r\n0\r\nX-Pad: " + b"p" * 400_000 + b"\r\n\r\n",
    ],  # fmt: skip
    ids=["endless-extension", "tiny-chunks", "endless-trailer"],
)
async def test_a_chunked_body_s_framing_is_bounded(proxy, framing: bytes) -> None:
    """What chunk framing adds (sizes, extensions, trailers) is refused past 64 KB, never held: one connection
    sending an endless extension or trailer, or a body in two-byte chunks, cost the proxy memory without bound."""
    before = request_counts(proxy)
    head = http_post(call("add", {"a": 1, "b": 2}), body=b"").replace(
        b"Content-Length: 0\r\n", b"Transfer-Encoding: chunked\r\n"
    )
    received = await raw_exchange(port_of(proxy), head + framing)
    (status, fields, body) = answers(received)[0]
    assert status == 400 and b"framing exceeds" in body and fields.get("Connection") == "close"
    assert counted(before, request_counts(proxy)) == {("none", "local", "400"): 1}  # its log line and metrics


async def test_the_lane_s_own_refusals_are_counted_and_logged(make_proxy, mcp_upstream):
    proxy = await make_proxy(mcp_upstream, protocol="modern", limits={"max_body_bytes": 1024})
    before = request_counts(proxy)
    received = await raw_exchange(port_of(proxy), chunked_post(call("echo", {"text": "x" * 2000})))
    assert answers(received)[0][0] == 413
    assert counted(before, request_counts(proxy)) == {("none", "local", "413"): 1}


async def test_what_waits_behind_a_refused_request_is_dropped(make_proxy, mcp_upstream, caplog):
    """Pipelined behind a request the lane refuses: nothing more is read or answered on that connection (one
    refusal, then the end), and nothing is written after the answer that ended it."""
    proxy = await make_proxy(mcp_upstream, protocol="modern", limits={"max_body_bytes": 1024})
    first = http_post(call("add", {"a": 1, "b": 2}))
    refused = chunked_post(call("echo", {"text": "x" * 2000}))
    with caplog.at_level("ERROR", logger="asyncio"):
        received = await raw_exchange(port_of(proxy), first + refused + http_post(call("add", {"a": 2, "b": 2})))
    assert [status for status, _, _ in answers(received)] == [200, 413], received
    assert not [record for record in caplog.records if record.name == "asyncio"], caplog.text
