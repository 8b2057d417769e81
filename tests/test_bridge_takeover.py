"""A 2026 client's synchronous call bridged to a 2025 server whose question comes on the session's standalone
stream while the lane reads the call in the request's own task (proxy/upstream/bridge.py, `SyncBridge._drive`):
the task that brings the question answers the client, as the request itself would have."""

from __future__ import annotations

import asyncio
import itertools
import json
import urllib.parse

import structlog
from aiohttp import web

from mcp_tasks_proxy.front.context import bridge_key
from mcp_tasks_proxy.front.lane import server as lane_server
from mcp_tasks_proxy.log import _add_request_id
from tests.conftest import eventually
from tests.factories import headers_for, meta, request


class StandaloneAsker:
    """A 2025-11-25 server whose `slow` tool waits for the answer to roots/list, which the test sends on the
    session's standalone stream (`ask`); `quick` answers at once."""

    def __init__(self) -> None:
        self.pushed: asyncio.Queue[dict | None] = asyncio.Queue()
        self.answered: asyncio.Future[dict] = asyncio.get_running_loop().create_future()
        self.received: list[dict] = []
        self.sessions = itertools.count(1)

    def ask(self, **params: object) -> None:
        self.pushed.put_nowait({"jsonrpc": "2.0", "id": "roots-1", "method": "roots/list", "params": params})

    async def told_of_cancel(self, tool: str) -> None:
        """Wait until the proxy has posted notifications/cancelled for the one call of `tool`."""
        (call_id,) = await calls_of(self, tool)

        async def told() -> bool:
            cancelled = [m for m in self.received if m.get("method") == "notifications/cancelled"]
            return any(m["params"]["requestId"] == call_id for m in cancelled)

        await eventually(told, what=f"notifications/cancelled for the call of {tool}")

    async def handle(self, http: web.Request) -> web.StreamResponse:
        if http.method == "DELETE":
            return web.Response()
        if http.method == "GET":
            stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await stream.prepare(http)
            while (pushed := await self.pushed.get()) is not None:
                await stream.write(f"data: {json.dumps(pushed)}\n\n".encode())
            return stream
        message = json.loads(await http.read())
        self.received.append(message)
        method = message.get("method")
        if method == "initialize":
            result = {"protocolVersion": "2025-11-25", "capabilities": {"tools": {}}, "serverInfo": {"name": "s"}}
            answer = {"jsonrpc": "2.0", "id": message["id"], "result": result}
            return web.json_response(answer, headers={"Mcp-Session-Id": f"s{next(self.sessions)}"})
        if method is None:  # the proxy's answer to roots-1
            if not self.answered.done():
                self.answered.set_result(message)
            return web.Response(status=202)
        if method.startswith("notifications/"):
            return web.Response(status=202)
        if method == "tools/list":
            tools = [{"name": name, "inputSchema": {"type": "object"}} for name in ("quick", "slow")]
            return web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": {"tools": tools}})
        if message["params"]["name"] == "hasty":  # asks on the call's stream, then answers without waiting
            stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await stream.prepare(http)
            ask = {"jsonrpc": "2.0", "id": "roots-2", "method": "roots/list", "params": {}}
            done = {"jsonrpc": "2.0", "id": message["id"], "result": {"content": [{"type": "text", "text": "gone"}]}}
            await stream.write(f"data: {json.dumps(ask)}\n\ndata: {json.dumps(done)}\n\n".encode())
            return stream
        if message["params"]["name"] == "quick":
            result = {"content": [{"type": "text", "text": "quick"}]}
            return web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": result})
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(http)
        roots = (await self.answered).get("result", {}).get("roots", [])
        done = {"jsonrpc": "2.0", "id": message["id"], "result": {"content": [{"type": "text", "text": str(roots)}]}}
        await stream.write(f"data: {json.dumps(done)}\n\n".encode())
        return stream


def slow_call() -> dict:
    return request("tools/call", {"name": "slow", "arguments": {}, "_meta": meta(tasks=False, roots={})})


async def started(make_proxy, fake_upstream):
    server = StandaloneAsker()
    fake = await fake_upstream(server.handle)
    proxy = await make_proxy(fake.url, protocol="legacy", logging={"level": "info"})
    # A first call opens the session and its standalone stream.
    opened = await proxy.client.call("tools/call", {"name": "quick", "arguments": {}, "_meta": meta(tasks=False)})
    assert opened.result["content"][0]["text"] == "quick"
    return server, proxy


async def raw_post(url: str, message: dict) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    where = urllib.parse.urlparse(url)
    reader, writer = await asyncio.open_connection(where.hostname, where.port)
    body = json.dumps(message).encode()
    fields = {**headers_for(message), "Host": where.netloc, "Content-Length": str(len(body))}
    writer.write(f"POST {where.path} HTTP/1.1\r\n".encode())
    writer.write("".join(f"{name}: {value}\r\n" for name, value in fields.items()).encode() + b"\r\n" + body)
    return reader, writer


async def calls_of(server: StandaloneAsker, tool: str) -> list[object]:
    return [m["id"] for m in server.received if m.get("method") == "tools/call" and m["params"]["name"] == tool]


async def test_the_round_is_the_requests_own_in_its_answer_count_and_log_line(make_proxy, fake_upstream):
    server, proxy = await started(make_proxy, fake_upstream)
    try:
        with structlog.testing.capture_logs(processors=[_add_request_id]) as logs:
            asking = asyncio.ensure_future(proxy.client.send(slow_call(), headers={"X-Request-Id": "caller-B"}))
            await eventually(lambda: calls_of(server, "slow"), what="the slow call upstream")
            server.ask()
            first = await asyncio.wait_for(asking, timeout=30)
            ((key, question),) = first.result["inputRequests"].items()
            assert question["method"] == "roots/list"
            roots = {"roots": [{"uri": "file:///srv", "name": "srv"}]}
            retry = slow_call()
            retry["params"].update(inputResponses={key: roots}, requestState=first.result["requestState"])
            done = await asyncio.wait_for(proxy.client.send(retry), timeout=30)
        assert "file:///srv" in done.result["content"][0]["text"]
        handled = [(line.get("tool"), line.get("request_id")) for line in logs if line["event"] == "request_handled"]
        assert handled[0] == ("slow", "caller-B")  # not the id of the request that opened the standalone stream
        assert len(handled) == 2
        assert len(proxy.app[bridge_key]._parked) == 0
    finally:
        server.pushed.put_nowait(None)


async def test_a_client_that_leaves_while_its_round_is_gathered_leaves_nothing_parked(make_proxy, fake_upstream):
    server, proxy = await started(make_proxy, fake_upstream)
    try:
        _, writer = await raw_post(proxy.url, slow_call())
        await eventually(lambda: calls_of(server, "slow"), what="the slow call upstream")
        server.ask()
        await asyncio.sleep(0.02)  # inside the 50 ms in which questions sent together are gathered
        writer.transport.abort()
        await server.told_of_cancel("slow")
        await asyncio.sleep(0.1)  # past the gather
        assert len(proxy.app[bridge_key]._parked) == 0  # the round that could not be delivered holds no slot
    finally:
        server.pushed.put_nowait(None)


async def test_a_question_the_proxy_cannot_encode_ends_the_request_with_an_error_and_the_call(
    make_proxy, fake_upstream
):
    server, proxy = await started(make_proxy, fake_upstream)
    try:
        reader, writer = await raw_post(proxy.url, slow_call())
        await eventually(lambda: calls_of(server, "slow"), what="the slow call upstream")
        deep: dict = {}
        for _ in range(600):  # past what the proxy encodes again (512 levels)
            deep = {"a": deep}
        server.ask(_meta=deep)
        answer = await asyncio.wait_for(reader.read(), timeout=10)  # then the connection ends
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        assert b"\r\nconnection: close" in head.lower()  # no client sends another request on a connection that ends
        assert json.loads(body)["error"] == {"code": -32603, "message": "Internal error in the proxy"}
        await server.told_of_cancel("slow")
        assert len(proxy.app[bridge_key]._parked) == 0
        writer.close()
    finally:
        server.pushed.put_nowait(None)


async def test_a_call_that_ends_while_its_questions_are_gathered_is_answered(make_proxy, fake_upstream):
    """The server asks, then answers the call at once: the client gets the answer, not a round whose retry would
    wait for an answer already read."""
    server, proxy = await started(make_proxy, fake_upstream)
    try:
        call = request("tools/call", {"name": "hasty", "arguments": {}, "_meta": meta(tasks=False, roots={})})
        reply = await asyncio.wait_for(proxy.client.send(call), timeout=30)
        assert reply.result["content"][0]["text"] == "gone", reply.message
        assert len(proxy.app[bridge_key]._parked) == 0
    finally:
        server.pushed.put_nowait(None)


async def test_a_question_taken_over_while_the_proxy_stops_ends_the_wait_for_answers(make_proxy, fake_upstream):
    """The lane waits up to 15 s for the answers it owes when the proxy stops. A question on the standalone stream
    answers the request from another task while the request's own task reads the call on for the parked round:
    the wait ends with the answer, not with that task."""
    server, proxy = await started(make_proxy, fake_upstream)
    try:
        reader, writer = await raw_post(proxy.url, slow_call())
        await eventually(lambda: calls_of(server, "slow"), what="the slow call upstream")
        stopping = asyncio.ensure_future(proxy.lane.shutdown(15))
        await asyncio.sleep(0.05)
        assert not stopping.done()  # an answer is owed
        server.ask()
        answer = await asyncio.wait_for(reader.read(), timeout=10)  # the round, then the connection ends
        head, _, body = answer.partition(b"\r\n\r\n")
        assert b"\r\nconnection: close" in head.lower()
        assert json.loads(body)["result"]["resultType"] == "input_required"
        await asyncio.wait_for(stopping, timeout=5)  # before the fix: the whole 15 s
        bridge = proxy.app[bridge_key]
        assert len(bridge._parked) == 1  # the round stays for a retry until the bridge closes, next in the stop
        await bridge.aclose()
        await server.told_of_cancel("slow")
        writer.close()
    finally:
        server.pushed.put_nowait(None)


class RacingAsker(StandaloneAsker):
    """`race` answers on its stream when the test says so: after its question was asked on the standalone stream,
    while the proxy gathers the questions sent with it."""

    def __init__(self) -> None:
        super().__init__()
        self.go = asyncio.Event()

    async def handle(self, http: web.Request) -> web.StreamResponse:
        if http.method == "POST":
            message = json.loads(await http.read())  # aiohttp keeps the body: the parent's handler reads it again
            if message.get("method") == "tools/call" and message["params"]["name"] == "race":
                self.received.append(message)
                stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await stream.prepare(http)
                await self.go.wait()
                result = {"content": [{"type": "text", "text": "raced"}]}
                done = {"jsonrpc": "2.0", "id": message["id"], "result": result}
                await stream.write(f"data: {json.dumps(done)}\n\n".encode())
                return stream
        return await super().handle(http)


class _CountedWaits:
    """The lane's asyncio, counting the stop's passes (each waits or sleeps once)."""

    def __init__(self) -> None:
        self.passes = 0

    def __getattr__(self, name: str) -> object:
        return getattr(asyncio, name)

    async def wait(self, *args: object, **kwargs: object) -> object:
        self.passes += 1
        return await asyncio.wait(*args, **kwargs)

    async def sleep(self, delay: float) -> None:
        self.passes += 1
        await asyncio.sleep(delay)


async def test_a_stop_that_waits_for_a_taken_over_answer_does_not_spin(make_proxy, fake_upstream, monkeypatch):
    """The request's own task may end (the call answered upstream) while the task that took the question over still
    owes the client its answer: the stop waits for that answer without spinning on the ended task."""
    server = RacingAsker()
    fake = await fake_upstream(server.handle)
    proxy = await make_proxy(fake.url, protocol="legacy")
    opened = await proxy.client.call("tools/call", {"name": "quick", "arguments": {}, "_meta": meta(tasks=False)})
    assert opened.result["content"][0]["text"] == "quick"
    counted = _CountedWaits()
    monkeypatch.setattr(lane_server, "asyncio", counted)
    try:
        race = request("tools/call", {"name": "race", "arguments": {}, "_meta": meta(tasks=False, roots={})})
        reader, writer = await raw_post(proxy.url, race)
        await eventually(lambda: calls_of(server, "race"), what="the race call upstream")
        stopping = asyncio.ensure_future(proxy.lane.shutdown(15))
        await asyncio.sleep(0.05)
        server.ask()  # taken over by the task that brings it, which gathers for 50 ms ...
        await asyncio.sleep(0.01)
        server.go.set()  # ... while the call ends upstream and the request's own task with it
        await asyncio.wait_for(stopping, timeout=5)
        answer = await asyncio.wait_for(reader.read(), timeout=5)
        assert b'"raced"' in answer  # the client has the call's answer
        writer.close()
        assert counted.passes < 100, f"{counted.passes} passes of the stop's wait"  # a spin makes thousands
    finally:
        server.pushed.put_nowait(None)
