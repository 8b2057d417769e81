"""A real proxy process in front of an upstream that breaks HTTP on purpose: bad framing, gzip bombs, huge results,
event streams of millions of lines. The proxy answers each with a clear error or a faithful relay, its memory stays
bounded (RSS read from /proc while it runs) and its event loop stays responsive (/healthz answers throughout)."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest

from tests.conftest import PROXY, ROOT, free_port, stop, task_reaches, wait_for_port
from tests.factories import McpClient, meta

MAX_RESULT_BYTES = 1024 * 1024

Script = Callable[[asyncio.StreamWriter, dict], Awaitable[None]]


def ok(request: dict, payload: dict | None = None) -> bytes:
    body = json.dumps({"jsonrpc": "2.0", "id": request["id"], "result": payload or {"content": []}}).encode()
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


def raw(data: bytes) -> Script:
    async def script(writer: asyncio.StreamWriter, request: dict) -> None:
        writer.write(data)
        await writer.drain()
        writer.close()

    return script


def with_answer(head: bytes, body: Callable[[bytes], bytes]) -> Script:
    """A response whose body is made from the JSON-RPC answer to the request (for framings that carry it)."""

    async def script(writer: asyncio.StreamWriter, request: dict) -> None:
        answer = json.dumps({"jsonrpc": "2.0", "id": request["id"], "result": {"content": []}}).encode()
        writer.write(head + body(answer))
        await writer.drain()
        writer.close()

    return script


class HostileUpstream:
    """HTTP/1.1 written by hand on purpose: it must send what no server library would. Requests are routed by tool
    name (tools/call) or method; anything unscripted gets an ordinary JSON-RPC result."""

    def __init__(self) -> None:
        self.scripts: dict[str, Script] = {}
        self.finished: dict[str, asyncio.Event] = {}
        self.server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handler = asyncio.current_task()
        assert handler is not None
        self._handlers.add(handler)
        handler.add_done_callback(self._handlers.discard)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                     if line.lower().startswith(b"content-length:")), 0,
                )  # fmt: skip
                request = json.loads(await reader.readexactly(length))
                params = request.get("params") or {}
                key = params.get("name") if request.get("method") == "tools/call" else request.get("method")
                script = self.scripts.get(key)
                if script is None:
                    writer.write(ok(request))
                    await writer.drain()
                    continue
                try:
                    await script(writer, request)
                finally:
                    self.finished.setdefault(key, asyncio.Event()).set()
                return
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()
            # Closed before the handler ends: a transport still closing when the test's loop ends is left to the
            # collector, whose "unclosed transport" warning then fails whichever test runs at that moment.
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def aclose(self) -> None:
        assert self.server is not None
        self.server.close()
        for handler in list(self._handlers):
            handler.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    def done(self, key: str) -> asyncio.Event:
        return self.finished.setdefault(key, asyncio.Event())

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/mcp"


class RunningProxy:
    def __init__(self, process: subprocess.Popen[bytes], port: int, session: aiohttp.ClientSession) -> None:
        self.process = process
        self.base = f"http://127.0.0.1:{port}"
        self.session = session
        self.client = McpClient(session, f"{self.base}/mcp")

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    @contextlib.asynccontextmanager
    async def watched(self) -> AsyncIterator[dict]:
        """While the body runs: the proxy's peak RSS over its RSS at the start, and /healthz asked every 100 ms
        (each must answer within 5 s: the defects this guards against froze the loop for 2 to 40 s)."""
        seen = {"start": self.rss_bytes(), "peak": 0, "health_answers": 0}
        answered = asyncio.Event()

        async def watch() -> None:
            while True:
                seen["peak"] = max(seen["peak"], self.rss_bytes())
                timeout = aiohttp.ClientTimeout(total=5)
                async with self.session.get(f"{self.base}/healthz", timeout=timeout) as response:
                    assert response.status == 200
                seen["health_answers"] += 1
                answered.set()
                await asyncio.sleep(0.1)

        watcher = asyncio.ensure_future(watch())
        try:
            yield seen
        finally:
            # At least one full round, however fast the body was (or the watcher's failure, if it failed).
            first = asyncio.ensure_future(answered.wait())
            await asyncio.wait([watcher, first], return_when=asyncio.FIRST_COMPLETED)
            first.cancel()
            if watcher.done():
                watcher.result()  # a /healthz that did not answer in time fails the test here
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        seen["growth"] = seen["peak"] - seen["start"]


@pytest.fixture
async def hostile() -> AsyncIterator[tuple[HostileUpstream, RunningProxy]]:
    upstream = HostileUpstream()
    upstream.server = await asyncio.start_server(upstream.handle, "127.0.0.1", 0, limit=1024 * 1024)
    port = free_port()
    policy = Path(ROOT / ".pytest_cache").joinpath(f"hostile-{port}.yaml")
    policy.parent.mkdir(exist_ok=True)
    policy.write_text(
        "upstream: {protocol: modern}\n"
        "tasks: {poll_interval_ms: 50, shutdown_grace_s: 0}\n"
        f"limits: {{max_result_bytes: {MAX_RESULT_BYTES}}}\n"
        "tools:\n  - match: 'task_*'\n"
    )
    process = subprocess.Popen(
        [*PROXY, "--config", str(policy), "--upstream", upstream.url, "--port", str(port),
         "--log-level", "error"],
        cwd=ROOT,
    )  # fmt: skip
    try:
        await asyncio.to_thread(wait_for_port, port, process)
        async with aiohttp.ClientSession() as session:
            yield upstream, RunningProxy(process, port, session)
    finally:
        stop(process)
        await upstream.aclose()
        policy.unlink(missing_ok=True)


async def task_outcome(proxy: RunningProxy, tool: str) -> dict:
    created = await proxy.client.call("tools/call", {"name": tool, "arguments": {}, "_meta": meta()})
    assert created.result["resultType"] == "task", created.message
    done = await task_reaches(proxy.client, created.result["taskId"], "completed", "failed")
    return done.result


def passthrough_message(method: str) -> tuple[dict, dict]:
    message = {"jsonrpc": "2.0", "id": 5, "method": method, "params": {"_meta": meta()}}
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream",
               "MCP-Protocol-Version": "2026-07-28", "Mcp-Method": method}  # fmt: skip
    return message, headers


# Framings the old hand-written client got wrong (defect 6), each for a background call and for pass-through.
_CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
_FRAMING = {
    "cut-mid-chunk": (_CHUNKED + b"Content-Type: application/json\r\n\r\n40\r\n{\"jsonrpc\":\"2.0\",\"id\":1",
                      "closed the connection before the response"),
    "lf-only-head": (b"HTTP/1.1 200 OK\nContent-Type: application/json\nContent-Length: 2\n\n{}",
                     "Missing expected CR"),
    "hex-prefix-chunk-size": (_CHUNKED + b"\r\n0x1f\r\n" + b"a" * 31 + b"\r\n0\r\n\r\n",
                              "Invalid character in chunk size"),
    "underscore-chunk-size": (_CHUNKED + b"\r\n1_0\r\n" + b"a" * 16 + b"\r\n0\r\n\r\n",
                              "Invalid character in chunk size"),
    "length-and-chunked": (b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc"
                           b"\r\n0\r\n\r\n",
                           "Transfer-Encoding can't be present with Content-Length"),
    "head-over-64k": (b"HTTP/1.1 200 OK\r\n" + b"X-Pad: " + b"a" * 70_000 + b"\r\nContent-Length: 0\r\n\r\n",
                      "response head exceeds 65536 bytes"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(_FRAMING))
async def test_bad_framing_fails_a_background_call_with_the_reason(hostile, case) -> None:
    upstream, proxy = hostile
    data, reason = _FRAMING[case]
    upstream.scripts["task_framing"] = raw(data)
    result = await task_outcome(proxy, "task_framing")
    assert result["status"] == "failed"
    assert reason in result["statusMessage"], result


_BODY_FAULTS = {"cut-mid-chunk", "hex-prefix-chunk-size", "underscore-chunk-size"}
"""Faults found only after the head: a streamed pass-through has relayed the head by then."""


@pytest.mark.parametrize("case", list(_FRAMING))
async def test_bad_framing_in_pass_through_is_a_broken_or_refused_response_never_a_clean_one(hostile, case) -> None:
    upstream, proxy = hostile
    data, _ = _FRAMING[case]
    upstream.scripts["hostile/framing"] = raw(data)
    message, headers = passthrough_message("hostile/framing")
    try:
        async with proxy.session.post(f"{proxy.base}/mcp", json=message, headers=headers,
                                      timeout=aiohttp.ClientTimeout(total=30)) as response:  # fmt: skip
            body = await response.read()
    except aiohttp.ClientPayloadError:
        assert case in _BODY_FAULTS  # the head was relayed as it came; the body breaks where the upstream's did
        return
    # (A JSON answer of unknown length is read before its head is relayed, to check its id: a fault in its body is
    # then refused as any other.)
    assert response.status == 502, (response.status, body[:200])
    error = json.loads(body)["error"]
    assert error["code"] == -32603 and "Upstream failure" in error["message"]


@pytest.mark.parametrize("status", [204, 304])
async def test_no_content_with_a_content_length_is_relayed_at_once(hostile, status) -> None:
    upstream, proxy = hostile
    upstream.scripts["hostile/empty"] = raw(b"HTTP/1.1 %d Nothing\r\nContent-Length: 20\r\n\r\n" % status)
    message, headers = passthrough_message("hostile/empty")
    async with proxy.session.post(f"{proxy.base}/mcp", json=message, headers=headers,
                                  timeout=aiohttp.ClientTimeout(total=30)) as response:  # fmt: skip
        assert response.status == status
        assert await response.read() == b""


async def test_a_gzip_bomb_as_a_result_fails_the_task_at_the_limit_with_bounded_memory(hostile) -> None:
    upstream, proxy = hostile
    bomb = gzip.compress(b"\0" * (300 * 1024 * 1024), compresslevel=9)  # ~300 KB that inflates to 300 MB
    upstream.scripts["task_bomb"] = raw(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(bomb), bomb)
    )
    async with proxy.watched() as seen:
        result = await task_outcome(proxy, "task_bomb")
    assert result["status"] == "failed"
    assert f"exceeds limits.max_result_bytes ({MAX_RESULT_BYTES})" in result["statusMessage"]
    assert seen["growth"] < 100 * 1024 * 1024, seen


async def test_a_huge_result_is_not_read_past_the_limit(hostile) -> None:
    upstream, proxy = hostile
    total = 400 * 1024 * 1024
    sent = 0

    async def huge(writer: asyncio.StreamWriter, request: dict) -> None:
        nonlocal sent
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % total)
        writer.write(
            b'{"jsonrpc":"2.0","id":%s,"result":{"content":[{"type":"text","text":"'
            % json.dumps(request["id"]).encode()
        )
        piece = b"x" * (1024 * 1024)
        with contextlib.suppress(ConnectionError):
            while sent < total - 2 * len(piece):
                writer.write(piece)
                await writer.drain()
                sent += len(piece)
        writer.close()

    upstream.scripts["task_huge"] = huge
    async with proxy.watched() as seen:
        result = await task_outcome(proxy, "task_huge")
        await asyncio.wait_for(upstream.done("task_huge").wait(), 60)
    assert result["status"] == "failed"
    assert f"exceeds limits.max_result_bytes ({MAX_RESULT_BYTES})" in result["statusMessage"]
    assert sent < 64 * 1024 * 1024, sent  # the proxy stopped reading (socket buffers aside), then hung up
    assert seen["growth"] < 100 * 1024 * 1024, seen


def many_line_stream(request: dict, lines: int) -> bytes:
    answer = json.dumps(
        {"jsonrpc": "2.0", "id": request["id"], "result": {"content": [{"type": "text", "text": "done"}]}}
    )
    # Half the lines are keep-alive comments of one long event, half end tiny events of their own.
    return b": x\n" * (lines // 2) + b": k\n\n" * (lines // 4) + b"event: message\ndata: " + answer.encode() + b"\n\n"


@pytest.mark.parametrize("compressed", [False, True], ids=["plain", "gzip"])
async def test_an_event_stream_of_millions_of_lines_is_read_in_linear_time(hostile, compressed) -> None:
    upstream, proxy = hostile

    async def stream(writer: asyncio.StreamWriter, request: dict) -> None:
        body = many_line_stream(request, 2_000_000)  # 6 MB of lines before the answer
        encoding = b""
        if compressed:
            body, encoding = gzip.compress(body), b"Content-Encoding: gzip\r\n"
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n%sContent-Length: %d\r\n\r\n"
                     % (encoding, len(body)))  # fmt: skip
        for offset in range(0, len(body), 64 * 1024):
            writer.write(body[offset : offset + 64 * 1024])
            await writer.drain()
        writer.close()

    upstream.scripts["task_lines"] = stream
    async with proxy.watched() as seen:
        result = await task_outcome(proxy, "task_lines")
    assert result["status"] == "completed", result.get("statusMessage")
    assert result["result"]["content"] == [{"type": "text", "text": "done"}]
    assert seen["health_answers"] >= 1 and seen["growth"] < 100 * 1024 * 1024, seen


async def test_an_event_larger_than_the_limit_fails_the_task_instead_of_growing(hostile) -> None:
    upstream, proxy = hostile

    async def endless_event(writer: asyncio.StreamWriter, request: dict) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        line = b"data: " + b"y" * 8000 + b"\n"  # one event that never ends
        chunk = b"%x\r\n%s\r\n" % (len(line) * 16, line * 16)
        with contextlib.suppress(ConnectionError):
            for _ in range(4000):  # 500 MB if nobody stops it
                writer.write(chunk)
                await writer.drain()
        writer.close()

    upstream.scripts["task_endless"] = endless_event
    async with proxy.watched() as seen:
        result = await task_outcome(proxy, "task_endless")
    assert result["status"] == "failed"
    assert "max_result_bytes" in result["statusMessage"], result
    assert seen["growth"] < 100 * 1024 * 1024, seen


async def test_a_large_pass_through_body_streams_with_its_length_in_bounded_memory(hostile) -> None:
    upstream, proxy = hostile
    total = 300 * 1024 * 1024

    async def large(writer: asyncio.StreamWriter, request: dict) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: %d\r\n\r\n" % total)
        piece = bytes(range(256)) * 4096
        with contextlib.suppress(ConnectionError):
            for _ in range(total // len(piece)):
                writer.write(piece)
                await writer.drain()
        writer.close()

    upstream.scripts["hostile/large"] = large
    message, headers = passthrough_message("hostile/large")
    received = 0
    async with proxy.watched() as seen, proxy.session.post(f"{proxy.base}/mcp", json=message, headers=headers) as r:
        assert r.status == 200 and r.content_length == total
        async for chunk in r.content.iter_any():
            received += len(chunk)
    assert received == total
    assert seen["growth"] < 100 * 1024 * 1024, seen
