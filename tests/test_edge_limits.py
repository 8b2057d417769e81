"""The proxy's edge against hostile clients: slow request heads and bodies, too many connections, bursts of task
calls against a `refuse` limit, and what an unexpected error may write to the logs."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.conftest import ROOT, free_port, quiet_proxy, task_reaches
from tests.factories import meta
from tests.test_replicas import gate_tag


@pytest.fixture
def edge_proxy(mcp_upstream, tmp_path) -> Iterator[int]:
    """A real proxy process with small edge limits."""
    port = free_port()
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "listen: {header_timeout_s: 1, body_timeout_s: 1, max_connections: 20}\ntools:\n  - match: slow_report\n"
    )
    with quiet_proxy(policy, mcp_upstream, port):
        yield port


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the proxy sends until it closes the connection (the socket timeout bounds the wait)."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


async def healthz(port: int) -> int:
    timeout = aiohttp.ClientTimeout(total=10)
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}/healthz", timeout=timeout) as r,
    ):
        return r.status


async def test_slow_request_heads_are_closed_and_a_normal_client_is_served_meanwhile(edge_proxy) -> None:
    slow = []
    for _ in range(15):
        sock = connect(edge_proxy)
        sock.sendall(b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # a head that never ends
        slow.append(sock)
    try:
        assert await healthz(edge_proxy) == 200  # served while the slow ones hold their sockets
        started = time.monotonic()
        for sock in slow:
            await asyncio.to_thread(read_until_closed, sock)  # returns when the proxy hangs up (or times out)
        # Closed by the header timeout (1 s), long before the 30 s socket timeout would have ended the wait.
        assert time.monotonic() - started < 25
    finally:
        for sock in slow:
            sock.close()


async def test_a_body_slower_than_the_body_timeout_gets_408(edge_proxy) -> None:
    sock = connect(edge_proxy)
    try:
        sock.sendall(
            b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"jsonrpc":'
        )
        answer = await asyncio.to_thread(read_until_closed, sock)
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == -32600 and "listen.body_timeout_s" in body["error"]["message"]


async def test_connections_past_the_cap_get_503_and_are_counted(edge_proxy) -> None:
    held = []
    try:
        for _ in range(20):
            sock = connect(edge_proxy)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")  # kept alive after the answer
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            held.append(sock)
        extra = connect(edge_proxy)
        refused = await asyncio.to_thread(read_until_closed, extra)
        extra.close()
        assert refused.startswith(b"HTTP/1.1 503"), refused[:200]
        message = json.loads(refused.split(b"\r\n\r\n", 1)[1])
        assert "listen.max_connections" in message["error"]["message"]
    finally:
        for sock in held:
            sock.close()
    await asyncio.sleep(0.2)  # the proxy sees the held connections close
    async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{edge_proxy}/metrics") as response:
        metrics = await response.text()
    (line,) = [line for line in metrics.splitlines() if line.startswith("mcp_tasks_proxy_connections_refused_total")]
    assert float(line.split()[-1]) >= 1


async def test_a_burst_against_a_refuse_limit_admits_exactly_the_limit(make_proxy, mcp_upstream, upstream_client):
    """Defect 8: admission looked at the semaphore before taking it, so a burst admitted 51 of max_concurrency 10."""
    proxy = await make_proxy(mcp_upstream, tools=[{"match": "gated", "max_concurrency": 10, "on_limit": "refuse"}])
    tags = [gate_tag() for _ in range(200)]
    replies = await asyncio.gather(
        *(proxy.client.call("tools/call", {"name": "gated", "arguments": {"tag": tag}, "_meta": meta()})
          for tag in tags)
    )  # fmt: skip
    admitted = [(tag, r.result["taskId"]) for tag, r in zip(tags, replies, strict=True) if "result" in r.message]
    refused = [r.message["error"] for r in replies if "error" in r.message]
    assert len(admitted) == 10 and len(refused) == 190
    assert all("max_concurrency" in error["message"] for error in refused), refused[0]
    for tag, _ in admitted:
        await upstream_client.call_tool("release", {"tag": tag}, tasks=False)
    for _, task_id in admitted:
        await task_reaches(proxy.client, task_id, "completed")
    # Slots come back: the next call is admitted.
    tag = gate_tag()
    after = await proxy.client.call("tools/call", {"name": "gated", "arguments": {"tag": tag}, "_meta": meta()})
    assert after.result["resultType"] == "task"
    await upstream_client.call_tool("release", {"tag": tag}, tasks=False)


_RAISE_WITH_SECRETS = textwrap.dedent(
    """
    import structlog
    from mcp_tasks_proxy.log import configure_logging

    configure_logging(level="info", format="{format}")
    log = structlog.get_logger("test")

    def handle(arguments):
        input_responses = {{"q": {{"content": {{"answer": "hunter2-in-a-local"}}}}}}
        raise RuntimeError("the message names hunter2-in-a-message")

    try:
        handle({{"token": "hunter2-in-an-argument"}})
    except RuntimeError:
        log.exception("unhandled_error")
    """
)


@pytest.mark.parametrize("format", ["json", "console"])
def test_an_unexpected_error_is_logged_without_locals_or_messages(format, tmp_path: Path) -> None:
    script = tmp_path / "raise.py"
    script.write_text(_RAISE_WITH_SECRETS.format(format=format))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's proxy package, whatever is installed
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert "hunter2" not in done.stderr, done.stderr
    assert "RuntimeError" in done.stderr and "handle" in done.stderr  # what failed, and where, is still there
    if format == "json":
        (line,) = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
        (trace,) = line["exception"]
        assert trace["exc_type"] == "RuntimeError" and trace["frames"][-1]["name"] == "handle"
