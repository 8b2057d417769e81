"""Legacy-upstream details that need a scripted server: expired sessions, pings, session limits, error codes."""

from __future__ import annotations

import asyncio
import itertools
import json

import pytest
from aiohttp import web

from tests.conftest import eventually, task_reaches
from tests.factories import headers_for, meta, request

_ODD_ANSWERS = {
    "garbage": b"\x00\x01 not json",
    "array": b'[{"jsonrpc": "2.0", "id": 1, "result": {}}]',
    "string": b'"done"',
    "empty": b"",
    "huge": json.dumps({"jsonrpc": "2.0", "id": 1, "result": {"content": [{"type": "text", "text": "x" * 300_000}]}}),
}
"""JSON answers to a tools/call that carry no response object, or one past max_result_bytes."""


class ScriptedLegacyServer:
    """A 2025-11-25 server reduced to what these tests script; it records every message it receives."""

    def __init__(self) -> None:
        self.sessions = itertools.count(1)
        self.expired: set[str] = set()
        self.answers: dict[object, asyncio.Future] = {}
        self.deleted: list[str] = []
        self.received: list[tuple[str | None, dict]] = []
        self.extra_capabilities: dict = {}
        self.tools_list_body: bytes | None = None
        self.flood_count = 0
        self.tools: list[dict] | None = None
        self.release = asyncio.Event()
        self.protocol_version = "2025-06-18"
        self.headers: list[dict[str, str]] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        session = request.headers.get("Mcp-Session-Id")
        if request.method == "DELETE":
            self.deleted.append(session)
            return web.Response(status=200)
        if request.method == "GET":
            return web.Response(status=405)  # no standalone stream
        message = json.loads(await request.read())
        self.received.append((session, message))
        self.headers.append(dict(request.headers))
        method = message.get("method")
        if method == "initialize":
            result = {
                "protocolVersion": self.protocol_version,
                "capabilities": {"tools": {}, **self.extra_capabilities},
                "serverInfo": {"name": "s", "version": "1"},
            }
            headers = {"Mcp-Session-Id": f"s{next(self.sessions)}"}
            return web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": result}, headers=headers)
        if method is None or session is None or session in self.expired:
            if method is None:  # a response to one of our requests
                self.answers.setdefault(message["id"], asyncio.get_running_loop().create_future()).set_result(message)
                return web.Response(status=202)
            status = 404 if session in self.expired else 400
            return web.json_response(
                {"jsonrpc": "2.0", "id": "server-error", "error": {"code": -32600, "message": "no"}}, status=status
            )
        if method.startswith("notifications/"):
            return web.Response(status=202)
        if method == "tools/list" and self.tools is not None:
            return web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": {"tools": self.tools}})
        if method == "tools/call" and message["params"]["name"] == "nameless-task":
            # A CreateTaskResult whose taskId is no string: nothing the proxy could follow or cancel.
            task = {"taskId": 42, "status": "working", "createdAt": "2026-01-01T00:00:00Z", "ttl": None}
            return web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": {"task": task}})
        if method == "tools/list" and self.tools_list_body is not None:
            if not self.tools_list_body:
                assert request.transport is not None
                request.transport.close()  # the connection reset mid-request
                return web.Response(status=500)
            return web.Response(body=self.tools_list_body, content_type="application/json")
        if method == "resources/read":
            return web.json_response(
                {"jsonrpc": "2.0", "id": message["id"], "error": {"code": -32002, "message": "not found"}}
            )
        if method == "tools/call" and message["params"]["name"] == "pinger":
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            ping = {"jsonrpc": "2.0", "id": "ping-1", "method": "ping"}
            await response.write(f"id: 1\ndata: \n\nid: 2\ndata: {json.dumps(ping)}\n\n".encode())
            answer = await self.answers.setdefault("ping-1", asyncio.get_running_loop().create_future())
            result = {"content": [{"type": "text", "text": f"pong answered with {json.dumps(answer.get('result'))}"}]}
            done = {"jsonrpc": "2.0", "id": message["id"], "result": result}
            await response.write(f"id: 3\ndata: {json.dumps(done)}\n\n".encode())
            await response.write_eof()
            return response
        if method == "tools/call" and message["params"]["name"] == "flood":
            # A server that asks and asks: elicitations without end, never waiting for an answer.
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for n in range(self.flood_count):
                ask = {
                    "jsonrpc": "2.0",
                    "id": f"ask-{n}",
                    "method": "elicitation/create",
                    "params": {"message": "x" * 1000, "requestedSchema": {"type": "object", "properties": {}}},
                }
                await response.write(f"data: {json.dumps(ask)}\n\n".encode())
            await self.release.wait()
            return response
        if method == "tools/call" and message["params"]["name"] in _ODD_ANSWERS:
            body = _ODD_ANSWERS[message["params"]["name"]]
            return web.Response(body=body, content_type="application/json")
        if method == "tools/call" and message["params"]["name"] == "stall":
            await self.release.wait()  # no response headers until the test ends
        result = {"content": [{"type": "text", "text": f"ok on {session}"}], "isError": False}
        return web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": result})

    def cancelled(self) -> list[object]:
        """The request ids the proxy said it cancelled."""
        return [m["params"]["requestId"] for _, m in self.received if m.get("method") == "notifications/cancelled"]

    def call_ids(self, tool: str) -> list[object]:
        return [m["id"] for _, m in self.received if m.get("method") == "tools/call" and m["params"]["name"] == tool]

    async def told_of_cancel(self, tool: str) -> None:
        """Wait until the proxy has posted notifications/cancelled for the first call of `tool`."""

        async def told():
            return self.call_ids(tool) and self.call_ids(tool)[0] in self.cancelled()

        await eventually(told, what=f"notifications/cancelled for the call of {tool}")


async def scripted(fake_upstream):
    server = ScriptedLegacyServer()
    fake = await fake_upstream(server.handle)
    return server, fake


async def test_expired_session_is_initialized_again(make_proxy, fake_upstream):
    server, fake = await scripted(fake_upstream)
    proxy = await make_proxy(fake.url)
    first = await proxy.client.call_tool("anything", tasks=False)
    assert first.result["content"][0]["text"] == "ok on s1"
    assert first.result["resultType"] == "complete"
    server.expired.add("s1")
    second = await proxy.client.call_tool("anything", tasks=False)
    assert second.result["content"][0]["text"] == "ok on s2"
    initialize = [m for _, m in server.received if m.get("method") == "initialize"]
    assert len(initialize) == 2
    capabilities = initialize[0]["params"]["capabilities"]
    assert capabilities == {"elicitation": {"form": {}, "url": {}}, "sampling": {}, "roots": {"listChanged": False}}
    calls = [(session, m) for session, m in server.received if m.get("method") == "tools/call"]
    # Every call the proxy makes carries the session, and no 2026-only envelope.
    assert all(session is not None for session, _ in calls)
    assert all("io.modelcontextprotocol/clientCapabilities" not in (m["params"].get("_meta") or {}) for _, m in calls)


async def test_a_protocol_version_that_would_split_a_header_fails_the_call_and_is_never_sent(make_proxy, fake_upstream):
    # The server's initialize answer is the one field of the proxy's POSTs that the server itself chose.
    server, fake = await scripted(fake_upstream)
    server.protocol_version = "2025-06-18\r\nX-Smuggled: 1"
    proxy = await make_proxy(fake.url)
    answer = await proxy.client.call_tool("anything", tasks=False)
    assert answer.error is not None, answer
    assert "protocolVersion no header can carry" in answer.error["message"], answer.error
    assert not any("X-Smuggled" in headers for headers in server.headers)
    assert not any(m.get("method") == "tools/call" for _, m in server.received)

    async def ended():  # the session the server made for nothing is not left open
        return server.deleted == ["s1"]

    await eventually(ended, what="the refused session being ended with DELETE")
    # A version a header can carry is the server's to choose, odd or not.
    server.protocol_version = "2025-06-18 (draft)"
    answer = await proxy.client.call_tool("anything", tasks=False)
    assert answer.result["content"][0]["text"] == "ok on s2", answer


async def test_sessions_are_per_credential_and_bounded(make_proxy, fake_upstream):
    server, fake = await scripted(fake_upstream)
    proxy = await make_proxy(fake.url, upstream={"max_sessions": 1})
    alice = await proxy.client.call_tool("t", tasks=False, headers={"Authorization": "Bearer alice"})
    bob = await proxy.client.call_tool("t", tasks=False, headers={"Authorization": "Bearer bob"})
    assert alice.result["content"][0]["text"] == "ok on s1"
    assert bob.result["content"][0]["text"] == "ok on s2"

    async def deleted():
        return server.deleted == ["s1"]

    await eventually(deleted, what="the evicted session being ended with DELETE")


async def test_ping_on_the_stream_is_answered_by_the_proxy(make_proxy, fake_upstream):
    server, fake = await scripted(fake_upstream)
    proxy = await make_proxy(fake.url, tools=[{"match": "pinger"}])
    sync = await proxy.client.call_tool("pinger", tasks=False)
    assert sync.result["content"][0]["text"] == "pong answered with {}"
    server.answers.clear()
    created = await proxy.client.call_tool("pinger")
    done = await task_reaches(proxy.client, created.result["taskId"], "completed")
    assert done.result["result"]["content"][0]["text"] == "pong answered with {}"


async def test_legacy_not_found_code_becomes_invalid_params(make_proxy, fake_upstream):
    _, fake = await scripted(fake_upstream)
    proxy = await make_proxy(fake.url)
    reply = await proxy.client.call("resources/read", {"uri": "file:///nope"})
    assert reply.error["code"] == -32602
    assert reply.error["message"] == "not found"


async def test_forced_legacy_protocol_skips_the_probe(make_proxy, fake_upstream):
    server, fake = await scripted(fake_upstream)
    proxy = await make_proxy(fake.url, protocol="legacy")
    reply = await proxy.client.call("server/discover")
    assert reply.result["_meta"]["io.modelcontextprotocol/serverInfo"] == {"name": "s", "version": "1"}
    assert not any(m.get("method") == "server/discover" for _, m in server.received)


async def test_repeated_mcp_headers_are_all_dropped_towards_a_legacy_server(make_proxy, fake_upstream):
    server, fake = await scripted(fake_upstream)
    proxy = await make_proxy(fake.url)
    message = request("tools/call", {"name": "t", "arguments": {}, "_meta": meta(tasks=False)})
    headers = [*headers_for(message).items(), ("Mcp-Param-Region", "eu"), ("Mcp-Param-Region", "us")]
    async with proxy.client.session.post(proxy.url, data=json.dumps(message), headers=headers) as response:
        answer = await response.json()
    assert answer["result"]["content"][0]["text"] == "ok on s1"
    call = next(h for h in fake.received if b'"tools/call"' in h["body"])
    assert "Mcp-Param-Region" not in call["headers"] and "Mcp-Method" not in call["headers"]
    assert call["headers"]["MCP-Protocol-Version"] == "2025-06-18"


@pytest.mark.parametrize("tools_list", [b"", b"[" * 200_000], ids=["connection-reset", "deeply-nested"])
async def test_a_broken_tools_list_does_not_stop_calls_to_a_server_with_tasks(make_proxy, fake_upstream, tools_list):
    """The proxy lists tools to learn their taskSupport; when that listing fails, calls go on as plain calls."""
    server, fake = await scripted(fake_upstream)
    server.extra_capabilities = {"tasks": {"requests": {"tools": {"call": {}}}}}
    server.tools_list_body = tools_list
    proxy = await make_proxy(fake.url, tools=[{"match": "job", "task": "optional"}], tasks={"poll_interval_ms": 50})
    sync = await asyncio.wait_for(proxy.client.call_tool("anything", tasks=False), timeout=30)
    assert sync.result["content"][0]["text"] == "ok on s1"
    created = await proxy.client.call_tool("job")
    done = await task_reaches(proxy.client, created.result["taskId"], "completed")
    assert done.result["result"]["content"][0]["text"] == "ok on s1"


async def test_a_server_asking_without_end_fails_a_synchronous_call_at_max_input_rounds(make_proxy, fake_upstream):
    """The synchronous bridge counts a legacy server's questions as the task path does: past the limit the client
    gets a clear error at once (not a round of thousands) and the server is told to stop."""
    server, fake = await scripted(fake_upstream)
    server.flood_count = 2_000
    proxy = await make_proxy(fake.url, tasks={"max_input_rounds": 3})
    try:
        params = {"name": "flood", "arguments": {}, "_meta": meta(tasks=False, elicitation={})}
        reply = await asyncio.wait_for(proxy.client.send(request("tools/call", params)), timeout=30)
        assert reply.error is not None, reply.body[:300]
        assert reply.error["code"] == -32603
        assert "more than 3 times (max_input_rounds)" in reply.error["message"]
        assert len(reply.body) < 10_000  # the answer names the fault; it does not carry the questions

        await server.told_of_cancel("flood")
    finally:
        server.release.set()


async def test_a_call_dropped_before_the_response_headers_is_cancelled_upstream(make_proxy, fake_upstream):
    """A JSON-answering server that has not sent its headers yet still hears notifications/cancelled when the
    proxy gives up on the call (here the task's timeout_s)."""
    server, fake = await scripted(fake_upstream)
    proxy = await make_proxy(fake.url, tools=[{"match": "stall", "timeout_s": 0.5}])
    try:
        created = await proxy.client.call_tool("stall")
        failed = await task_reaches(proxy.client, created.result["taskId"], "failed")
        assert "timeout_s" in json.dumps(failed.result)

        await server.told_of_cancel("stall")
    finally:
        server.release.set()


async def test_a_create_task_result_without_a_usable_task_id_fails_the_call(make_proxy, fake_upstream):
    """It is not passed on as if it were the tool's result."""
    server, fake = await scripted(fake_upstream)
    server.extra_capabilities = {"tasks": {"requests": {"tools": {"call": {}}}}}
    server.tools = [
        {"name": "nameless-task", "inputSchema": {"type": "object"}, "execution": {"taskSupport": "required"}}
    ]
    proxy = await make_proxy(fake.url)
    reply = await asyncio.wait_for(proxy.client.call_tool("nameless-task", tasks=False), timeout=30)
    assert reply.error is not None and reply.error["code"] == -32603
    assert "no usable taskId" in reply.error["message"]


@pytest.mark.parametrize("tool", list(_ODD_ANSWERS))
async def test_a_json_answer_without_a_response_object_fails_the_call_and_the_next_one_goes_through(
    make_proxy, fake_upstream, tool
):
    """Read once as the call's one message: not JSON, not an object, nothing at all, or too large. A 2026 client's
    synchronous call and a task both end with the reason; the next call on the same session is answered."""
    server, fake = await scripted(fake_upstream)
    proxy = await make_proxy(fake.url, tools=[{"match": "task-*"}], limits={"max_result_bytes": 100_000})
    reason = "exceeds limits.max_result_bytes" if tool == "huge" else "closed its event stream before answering"
    reply = await asyncio.wait_for(proxy.client.call_tool(tool, tasks=False), timeout=30)
    assert reply.error is not None and reply.error["code"] == -32603, reply.message
    assert reason in reply.error["message"]

    as_task = await make_proxy(fake.url, tools=[{"match": tool}], limits={"max_result_bytes": 100_000})
    created = await as_task.client.call_tool(tool)
    failed = await task_reaches(as_task.client, created.result["taskId"], "failed")
    assert reason in failed.result["statusMessage"]

    again = await asyncio.wait_for(proxy.client.call_tool("plain", tasks=False), timeout=30)
    assert again.result is not None and again.result["content"][0]["text"] == "ok on s1", again.message
