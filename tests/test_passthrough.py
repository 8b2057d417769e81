"""Pass-through: what the proxy does not own reaches the upstream, and the answer comes back faithfully."""

from __future__ import annotations

import asyncio
import json
import secrets

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from mcp_tasks_proxy.upstream.http.sse import SseParser
from tests.conftest import eventually
from tests.factories import TASKS, headers_for, meta, parse_body, request


@pytest.fixture
def front(both_fronts: str) -> str:
    """Every test here runs through both readers, the lane and aiohttp's server (tests/conftest.py)."""
    return both_fronts


async def test_non_declaring_client_sees_exactly_the_upstream(make_proxy, mcp_upstream, upstream_client):
    proxy = await make_proxy(mcp_upstream, tools=[{"match": "slow_*"}])
    for method, params in [
        ("tools/list", {}),
        ("tools/call", {"name": "add", "arguments": {"a": 1, "b": 2}}),
        ("tools/call", {"name": "slow_report", "arguments": {"topic": "t", "seconds": 0}}),
        ("prompts/list", {}),
    ]:
        message = request(method, {**params, "_meta": meta(tasks=False)}, id=7)
        via_proxy = await proxy.client.send(message)
        direct = await upstream_client.send(message)
        assert via_proxy.status == direct.status
        assert via_proxy.body == direct.body, method
        assert via_proxy.headers["Content-Type"] == direct.headers["Content-Type"]


async def first_event(response: aiohttp.ClientResponse) -> dict:
    """Read just enough of an event stream for its first data event."""
    parser = SseParser()
    while True:
        chunk = await response.content.readany()
        assert chunk, "the stream ended before any event"
        for event in parser.feed(chunk):
            if event.data:
                return json.loads(event.data)


async def test_event_stream_is_relayed_as_it_arrives(make_proxy, mcp_upstream, upstream_client):
    # The gated tool emits a progress event and then waits for release(); a proxy that buffered the stream to
    # its end would deliver nothing before the release, so reading the first event first proves streaming.
    proxy = await make_proxy(mcp_upstream)
    gate = secrets.token_hex(6)
    message = request(
        "tools/call",
        {"name": "gated", "arguments": {"tag": gate}, "_meta": {**meta(tasks=False), "progressToken": "p"}},
    )
    async with proxy.client.session.post(proxy.url, data=json.dumps(message), headers=headers_for(message)) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        progress = await asyncio.wait_for(first_event(response), timeout=30)
        assert progress["method"] == "notifications/progress"
        assert progress["params"]["message"] == f"waiting at gate {gate}"
        await upstream_client.call_tool("release", {"tag": gate}, tasks=False)
        rest = await response.read()
    final, _ = parse_body("text/event-stream", rest)
    assert final["id"] == message["id"]
    assert final["result"]["content"][0]["text"] == f"gate {gate} opened"


async def test_client_closing_a_relayed_stream_cancels_the_upstream_call(make_proxy, mcp_upstream, upstream_client):
    proxy = await make_proxy(mcp_upstream)
    gate = secrets.token_hex(6)
    message = request(
        "tools/call", {"name": "gated", "arguments": {"tag": gate}, "_meta": {**meta(tasks=False), "progressToken": 1}}
    )
    async with (
        aiohttp.ClientSession() as session,
        session.post(proxy.url, data=json.dumps(message), headers=headers_for(message)) as response,
    ):
        await asyncio.wait_for(first_event(response), timeout=30)
    # The client's session is closed: the proxy must close the upstream stream, which cancels the tool.

    async def cancelled():
        state = await upstream_client.call_tool("gate_state", {"tag": gate}, tasks=False)
        return state.result["structuredContent"]["result"] == "cancelled"

    await eventually(cancelled, what="the upstream tool seeing the cancellation")


async def test_headers_status_and_methods_are_relayed(make_proxy, fake_upstream):
    async def handler(request: web.Request) -> web.StreamResponse:
        if request.method == "DELETE":
            return web.Response(status=204, headers={"X-Upstream": "deleted"})
        if request.method == "GET":
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Upstream": "stream"})
            await response.prepare(request)
            await response.write(b'data: {"jsonrpc":"2.0","method":"notifications/tools/list_changed"}\n\n')
            await response.write_eof()
            return response
        return web.Response(
            status=418,
            body=b'{"jsonrpc":"2.0","id":1,"result":{"resultType":"complete"}}',
            headers={"Content-Type": "application/json", "X-Upstream": "teapot", "Keep-Alive": "timeout=5"},
        )

    fake = await fake_upstream(handler)
    proxy = await make_proxy(fake.url, protocol="modern")
    session = proxy.client.session
    headers = {
        "Authorization": "Bearer abc",
        "Mcp-Session-Id": "session-1",
        "X-Custom": "kept",
        "Connection": "keep-alive, X-Hop",
        "X-Hop": "dropped because Connection names it",
        "Proxy-Authorization": "Basic dropped",
    }
    async with session.post(
        proxy.url + "?q=1", data=b'{"jsonrpc":"2.0","method":"notifications/initialized"}', headers=headers
    ) as response:
        assert response.status == 418
        assert response.headers["X-Upstream"] == "teapot"
        assert "Keep-Alive" not in response.headers
        assert await response.read() == b'{"jsonrpc":"2.0","id":1,"result":{"resultType":"complete"}}'
    sent = fake.received[-1]
    assert sent["path"] == "/mcp?q=1"
    assert sent["headers"]["Authorization"] == "Bearer abc"
    assert sent["headers"]["Mcp-Session-Id"] == "session-1"
    assert sent["headers"]["X-Custom"] == "kept"
    assert "X-Hop" not in sent["headers"] and "Proxy-Authorization" not in sent["headers"]
    assert sent["body"] == b'{"jsonrpc":"2.0","method":"notifications/initialized"}'

    async with session.get(
        proxy.url, headers={"Accept": "text/event-stream", "Mcp-Session-Id": "session-1"}
    ) as response:
        assert response.status == 200
        assert response.headers["X-Upstream"] == "stream"
        assert b"notifications/tools/list_changed" in await response.read()
    async with session.delete(proxy.url, headers={"Mcp-Session-Id": "session-1"}) as response:
        assert response.status == 204
        assert response.headers["X-Upstream"] == "deleted"
    assert [r["method"] for r in fake.received] == ["POST", "GET", "DELETE"]
    assert all(r["headers"]["Mcp-Session-Id"] == "session-1" for r in fake.received)


async def test_other_paths_reach_the_upstream_origin(make_proxy, fake_upstream):
    async def handler(request: web.Request) -> web.Response:
        return web.json_response({"resource": "https://example.test/mcp"})

    fake = await fake_upstream(handler)
    proxy = await make_proxy(fake.url, protocol="modern")
    base = proxy.url.removesuffix("/mcp")
    async with proxy.client.session.get(base + "/.well-known/oauth-protected-resource") as response:
        assert response.status == 200
        assert await response.json() == {"resource": "https://example.test/mcp"}
    assert fake.received[-1]["path"] == "/.well-known/oauth-protected-resource"


async def test_legacy_session_flow_passes_through(make_proxy, mcp_upstream):
    # A 2025-11-25 client: initialize, the Mcp-Session-Id session, tools/call, DELETE. The proxy owns none of it.
    proxy = await make_proxy(mcp_upstream, tools=[{"match": "slow_*", "task": "required"}])
    session = proxy.client.session
    base_headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    init = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-11-25",
            "capabilities": {},
            "clientInfo": {"name": "legacy", "version": "1"},
        },
    }
    async with session.post(proxy.url, json=init, headers=base_headers) as response:
        assert response.status == 200
        session_id = response.headers["Mcp-Session-Id"]
        message, _ = parse_body(response.headers["Content-Type"], await response.read())
    assert message["result"]["protocolVersion"] == "2025-11-25"
    legacy = {**base_headers, "Mcp-Session-Id": session_id, "MCP-Protocol-Version": "2025-11-25"}
    async with session.post(
        proxy.url, json={"jsonrpc": "2.0", "method": "notifications/initialized"}, headers=legacy
    ) as response:
        assert response.status == 202
    call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "add", "arguments": {"a": 3, "b": 4}}}
    async with session.post(proxy.url, json=call, headers=legacy) as response:
        message, _ = parse_body(response.headers["Content-Type"], await response.read())
    assert message["result"]["structuredContent"] == {"result": 7}
    # A legacy request's tasks/* belong to the upstream (the extension is undefined before 2026-07-28).
    get = {"jsonrpc": "2.0", "id": 3, "method": "tasks/get", "params": {"taskId": "x"}}
    async with session.post(proxy.url, json=get, headers=legacy) as response:
        message, _ = parse_body(response.headers["Content-Type"], await response.read())
    assert message["error"]["code"] != -32021
    async with session.delete(proxy.url, headers=legacy) as response:
        assert response.status in (200, 204)


async def test_declaration_and_legacy_task_param_are_not_forwarded(make_proxy, fake_upstream):
    async def handler(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        return web.json_response(
            {"jsonrpc": "2.0", "id": body["id"], "result": {"resultType": "complete", "content": []}}
        )

    fake = await fake_upstream(handler)
    proxy = await make_proxy(fake.url, protocol="modern", tools=[{"match": "long"}])
    passthrough_meta = meta(tasks=True, sampling={})
    await proxy.client.call(
        "tools/call", {"name": "quick", "arguments": {}, "task": {"ttl": 5}, "_meta": passthrough_meta}
    )
    created = await proxy.client.call("tools/call", {"name": "long", "arguments": {"x": 1}, "task": {"ttl": 5}})
    await eventually(lambda: _received(fake, 2), what="the background call")
    for sent in fake.received:
        body = json.loads(sent["body"])
        assert "task" not in body["params"]
        capabilities = body["params"]["_meta"]["io.modelcontextprotocol/clientCapabilities"]
        assert TASKS not in capabilities.get("extensions", {})
    first, second = (json.loads(r["body"]) for r in fake.received)
    assert first["params"]["_meta"]["io.modelcontextprotocol/clientCapabilities"] == {"sampling": {}}
    assert second["params"]["arguments"] == {"x": 1}
    assert second["id"] != created.message["id"]  # the background call has an id of its own


async def test_a_listen_the_proxy_passes_on_goes_without_the_declaration(make_proxy, fake_upstream):
    """subscriptions/listen without taskIds is the upstream's: like any request passed on, without the tasks
    declaration or a params.task."""

    async def handler(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        return web.json_response({"jsonrpc": "2.0", "id": body["id"], "result": {"resultType": "complete"}})

    fake = await fake_upstream(handler)
    proxy = await make_proxy(fake.url, protocol="modern")
    params = {"notifications": {"toolsListChanged": True}, "_meta": meta(tasks=True, sampling={}), "task": {}}
    await proxy.client.call("subscriptions/listen", params)
    [sent] = fake.received
    forwarded = json.loads(sent["body"])["params"]
    assert "task" not in forwarded
    assert forwarded["_meta"]["io.modelcontextprotocol/clientCapabilities"] == {"sampling": {}}
    assert forwarded["notifications"] == {"toolsListChanged": True}


def test_dumps_stops_at_a_depth_of_its_own_whatever_the_stack():
    from mcp_tasks_proxy.jsonrpc import MAX_DUMPS_DEPTH, dumps

    def nested(depth: int, leaf: object = 1) -> object:
        for _ in range(depth):
            leaf = [leaf]
        return leaf

    assert dumps(nested(254)) == b"[" * 254 + b"1" + b"]" * 254  # orjson's
    assert dumps(nested(MAX_DUMPS_DEPTH - 1)) == b"[" * (MAX_DUMPS_DEPTH - 1) + b"1" + b"]" * (MAX_DUMPS_DEPTH - 1)
    assert dumps(nested(300, 2**70)) == b"[" * 300 + b"%d" % 2**70 + b"]" * 300  # the standard library's
    for value in (nested(MAX_DUMPS_DEPTH + 1), {"a": nested(MAX_DUMPS_DEPTH)}, nested(MAX_DUMPS_DEPTH + 1, 2**70)):
        with pytest.raises(ValueError, match="levels deep"):
            dumps(value)

    def deep_in_the_stack(frames: int) -> bytes:
        return dumps(nested(MAX_DUMPS_DEPTH - 1)) if frames == 0 else deep_in_the_stack(frames - 1)

    assert deep_in_the_stack(200).startswith(b"[[")  # 200 frames deeper, the same answer
    with pytest.raises(ValueError, match="stack"):  # a caller deeper than the proxy's ever are: still a ValueError
        deep_in_the_stack(700)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=2), inner, max_size=3),
    max_leaves=40,
)


def _depth(value: object) -> int:
    """Levels of arrays and objects in `value`, recursively: the plain reading of what the walk measures."""
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


@settings(max_examples=300, deadline=None)
@given(_JSON, st.integers(min_value=0, max_value=12))
def test_the_nesting_walk_says_what_the_recursive_depth_says(value: object, limit: int) -> None:
    """The walk that decides what `dumps` refuses (level by level, in C loops) agrees with the recursive depth."""
    from mcp_tasks_proxy.jsonrpc import _nested_deeper

    assert _nested_deeper(value, limit) == (_depth(value) > limit)


async def _received(fake, count: int) -> bool:
    return len(fake.received) >= count


async def test_discover_drops_legacy_task_capabilities(make_proxy, fake_upstream):
    async def handler(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        result = {
            "resultType": "complete",
            "supportedVersions": ["2026-07-28"],
            "capabilities": {"tools": {}, "tasks": {"list": {}, "requests": {"tools": {"call": {}}}}},
            "ttlMs": 0,
            "cacheScope": "public",
        }
        payload = json.dumps({"jsonrpc": "2.0", "id": body["id"], "result": result})
        # Answer on an event stream, to prove the rewrite handles both content types.
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(f"event: message\ndata: {payload}\n\n".encode())
        await response.write_eof()
        return response

    fake = await fake_upstream(handler)
    proxy = await make_proxy(fake.url, protocol="modern")
    reply = await proxy.client.call("server/discover")
    assert reply.result["capabilities"] == {"tools": {}, "extensions": {TASKS: {}}}


async def test_a_post_answer_is_relayed_as_sent_compressed_chunked_and_with_repeated_headers(make_proxy, fake_upstream):
    import gzip

    document = b'{"jsonrpc":"2.0","id":7,"result":{"resultType":"complete","text":"' + b"z" * 3000 + b'"}}'

    async def handler(request: web.Request) -> web.StreamResponse:
        if request.query.get("shape") == "gzip":
            response = web.Response(body=gzip.compress(document), headers={"Content-Encoding": "gzip"})
        else:
            response = web.StreamResponse()  # no Content-Length: chunked on the wire
            await response.prepare(request)
            await response.write(document[:100])
            await response.write(document[100:])
            await response.write_eof()
            return response
        response.headers.add("Set-Cookie", "a=1")
        response.headers.add("Set-Cookie", "b=2")
        response.content_type = "application/json"
        return response

    fake = await fake_upstream(handler)
    proxy = await make_proxy(fake.url, protocol="modern")
    call = b'{"jsonrpc":"2.0","id":7,"method":"tools/list"}'
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        asks_gzip = {"Accept-Encoding": "gzip", "Content-Type": "application/json"}
        async with session.post(proxy.url + "?shape=gzip&x=%20y", data=call, headers=asks_gzip) as response:
            assert response.headers["Content-Encoding"] == "gzip"
            assert response.headers.getall("Set-Cookie") == ["a=1", "b=2"]
            assert gzip.decompress(await response.read()) == document
        async with session.post(proxy.url + "?shape=chunked", data=call) as response:
            assert response.status == 200
            assert await response.read() == document
    # (Before the first 2025 request, the proxy asked the 2026 server whether it takes 2025 clients: its own.)
    relayed = [each for each in fake.received if b"mtp-initialize" not in each["body"]]
    assert relayed[0]["path"] == "/mcp?shape=gzip&x=%20y"
    assert relayed[0]["headers"]["Accept-Encoding"] == "gzip"
    assert relayed[0]["body"] == call


def test_relayed_request_headers_are_the_bytes_received_without_hop_by_hop_ones_and_never_carry_cr_or_lf():
    from multidict import CIMultiDict, CIMultiDictProxy

    from mcp_tasks_proxy.upstream.http.headers import relayed_request_fields

    raw = (
        (b"Host", b"proxy:8080"),
        (b"Connection", b"keep-alive, X-Hop"),
        (b"X-Hop", b"1"),
        (b"Content-Length", b"2"),
        (b"X-Name", b"caf\xc3\xa9 \xff"),  # not re-encoded: the upstream gets the very bytes
        (b"mcp-method", b"tools/call"),
    )
    decoded = CIMultiDictProxy(CIMultiDict((k.decode(), v.decode("utf-8", "surrogateescape")) for k, v in raw))
    assert relayed_request_fields(raw, decoded) == b"X-Name: caf\xc3\xa9 \xff\r\nmcp-method: tools/call\r\n"
    for value in (b"a\r\nX-Smuggled: 1", b"a\nb", b"a\rb"):
        with pytest.raises(ValueError, match="CR or LF"):
            relayed_request_fields(((b"X-Bad", value),), CIMultiDictProxy(CIMultiDict()))
    # llhttp (the lane) keeps a value's trailing spaces and tabs, aiohttp strips them: the upstream gets the bytes
    # aiohttp's path would send, inner spaces kept.
    padded = ((b"Authorization", b"Bearer  me \t "), (b"X-Tab", b"a\t"), (b"X-Plain", b"b c"))
    assert relayed_request_fields(padded, CIMultiDictProxy(CIMultiDict())) == (
        b"Authorization: Bearer  me\r\nX-Tab: a\r\nX-Plain: b c\r\n"
    )


def test_a_bridged_calls_header_block_is_the_session_headers_serialized_and_never_carries_cr_or_lf():
    from multidict import CIMultiDict

    from mcp_tasks_proxy.upstream.http.headers import session_headers, session_post_fields
    from mcp_tasks_proxy.upstream.routing import LegacySession

    def serialized(headers: CIMultiDict[str]) -> bytes:  # as the lean client serializes a mapping
        return b"".join(f"{name}: {value}\r\n".encode("utf-8", "surrogateescape") for name, value in headers.items())

    client = CIMultiDict(
        [("Host", "proxy"), ("Connection", "keep-alive, X-Hop"), ("X-Hop", "1"), ("Content-Length", "2"),
         ("Authorization", "Bearer me"), ("Accept", "*/*"), ("Mcp-Method", "tools/call"), ("X-Name", "caf\xe9"),
         ("MCP-Protocol-Version", "2026-07-28"), ("Content-Type", "text/plain")]
    )  # fmt: skip
    for session in (LegacySession("s-1", "2025-06-18", "p"), LegacySession(None, "2025-11-25", "p")):
        block = session_post_fields(session, client)
        assert block == serialized(session_headers(session, client))
        assert b"X-Hop" not in block and b"Mcp-Method" not in block and b"Host" not in block
    assert session_post_fields(LegacySession("s", "2025-06-18", "p"), CIMultiDict()) == (
        b"Content-Type: application/json\r\nAccept: application/json, text/event-stream\r\n"
        b"MCP-Protocol-Version: 2025-06-18\r\nMcp-Session-Id: s\r\n"
    )
    for session, headers in (
        (LegacySession("s", "2025-06-18\r\nX-Smuggled: 1", "p"), CIMultiDict()),
        (LegacySession("s\nX: 1", "2025-06-18", "p"), CIMultiDict()),
        (LegacySession("s", "2025-06-18", "p"), CIMultiDict({"X-Bad": "a\rb"})),
        (LegacySession("s", "2025-06-18", "p"), CIMultiDict({"X-Bad:": "a"})),
    ):
        with pytest.raises(ValueError, match="cannot be sent"):
            session_post_fields(session, headers)


_NAMES = st.sampled_from(
    ["Host", "Authorization", "X-Name", "Connection", "X-Hop", "mcp-method", "MCP-Name", "Mcp-Session-Id", "Accept",
     "Content-Type", "Content-Length", "TE", "Keep-Alive", "x-a", "X-A", "Bad:Name", "Trailer"]
)  # fmt: skip
_VALUES = st.lists(st.sampled_from(list("ab ,:\t\r\né\udcff") + ["X-Hop", "x-a", "close"]), max_size=6).map("".join)


@settings(max_examples=400, deadline=None)
@given(
    fields=st.lists(st.tuples(_NAMES, _VALUES), max_size=8),
    version=_VALUES,
    session_id=st.one_of(st.none(), _VALUES),
)
def test_a_bridged_calls_header_block_is_what_the_lean_client_made_of_the_mapping(fields, version, session_id):
    """For any headers: the one-pass block is the bytes the lean client made of `session_headers`' mapping, and it
    refuses what the client refused (CR, LF, a colon in a name)."""
    from multidict import CIMultiDict

    from mcp_tasks_proxy.upstream.http.headers import session_headers, session_post_fields
    from mcp_tasks_proxy.upstream.routing import LegacySession

    def by_the_client(headers: CIMultiDict[str]) -> bytes:  # CallClient.post's own serialization of a mapping
        lines = []
        for name, value in headers.items():
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
                raise ValueError("cannot be sent")
            lines.append(f"{name}: {value}\r\n".encode("utf-8", "surrogateescape"))
        return b"".join(lines)

    session, client = LegacySession(session_id, version, "p"), CIMultiDict(fields)
    try:
        expected = by_the_client(session_headers(session, client))
    except ValueError:
        with pytest.raises(ValueError, match="cannot be sent"):
            session_post_fields(session, client)
        return
    assert session_post_fields(session, client) == expected


async def test_an_answer_the_proxy_rewrites_is_asked_for_without_a_coding(make_proxy, fake_upstream):
    """server/discover's answer is read and amended: asked for as `identity`, since without the field any coding
    would do (RFC 9110 12.5.3)."""

    async def discover(http: web.Request) -> web.Response:
        message = await http.json()
        result = {"supportedVersions": ["2026-07-28"], "capabilities": {}, "serverInfo": {"name": "f", "version": "0"}}
        return web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": result})

    fake = await fake_upstream(discover)
    proxy = await make_proxy(fake.url, protocol="modern")
    reply = await proxy.client.call("server/discover", {}, headers={"Accept-Encoding": "gzip, br"})
    assert "io.modelcontextprotocol/tasks" in reply.result["capabilities"]["extensions"]
    assert fake.received[-1]["headers"].getall("Accept-Encoding") == ["identity"]


@pytest.mark.parametrize("extra", [{}, {"task": {"ttl": 5}}], ids=["declared", "declared-and-params-task"])
async def test_a_client_that_declares_tasks_has_its_unowned_calls_relayed_without_the_declaration(
    make_proxy, fake_upstream, extra
):
    """A tasks-capable client declares the extension in every request, the calls the proxy does not own included:
    they go upstream without the declaration (nor a legacy params.task), everything else as sent, so the upstream
    cannot answer with a task of its own."""

    async def handler(http: web.Request) -> web.Response:
        body = json.loads(await http.read())
        return web.json_response({"jsonrpc": "2.0", "id": body["id"], "result": {"resultType": "complete"}})

    fake = await fake_upstream(handler)
    proxy = await make_proxy(fake.url, protocol="modern", tools=[{"match": "long", "task": "optional"}])
    for message in (
        request("tools/call", {"name": "quick", "arguments": {"a": 1}, "_meta": meta(sampling={}), **extra}),
        request("tools/list", {"_meta": meta(), **extra}),
    ):
        reply = await proxy.client.send(message)
        assert json.loads(reply.body) == {"jsonrpc": "2.0", "id": message["id"], "result": {"resultType": "complete"}}
        expected = json.loads(json.dumps(message))
        expected["params"].pop("task", None)
        capabilities = expected["params"]["_meta"]["io.modelcontextprotocol/clientCapabilities"]
        del capabilities["extensions"]["io.modelcontextprotocol/tasks"]
        if not capabilities["extensions"]:
            del capabilities["extensions"]
        assert json.loads(fake.received[-1]["body"]) == expected
