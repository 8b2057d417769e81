"""Calls sent again after a transient upstream failure (proxy/tasks/retries.py): a request that never left, for
every rule; one that got no answer (a reset, 429/502/503/504, a stdio child that exited), for idempotent rules."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import time

import pytest
from aiohttp import web

from mcp_tasks_proxy.upstream.events import retry_after_s
from tests.conftest import ROOT, eventually, free_port, legacy_python, stop, task_reaches, wait_for_port
from tests.test_operations import scrape, value
from tests.test_stdio import _gate_is, legacy_command, modern_command, stdio_proxy, tool_text

FAST = {"attempts": 40, "backoff_ms": 50, "max_backoff_ms": 250}


@pytest.mark.parametrize("protocol", ["modern", "auto"])  # auto: the era probe itself is refused first
async def test_a_call_that_never_left_is_sent_again_once_the_server_is_up(make_proxy, protocol):
    # Not idempotent (the default): a refused connection is still safe to try again, nothing reached the server.
    port = free_port()
    proxy = await make_proxy(
        f"http://127.0.0.1:{port}/mcp", protocol=protocol, tools=[{"match": "slow_report", "retry": FAST}]
    )
    created = await proxy.client.call_tool("slow_report", {"topic": "late", "seconds": 0})
    task_id = created.result["taskId"]
    await asyncio.sleep(0.3)  # refused a few times meanwhile
    server = subprocess.Popen([sys.executable, str(ROOT / "tests" / "upstream_server.py"), str(port)])
    try:
        wait_for_port(port, server)
        done = await task_reaches(proxy.client, task_id, "completed", "failed")
        assert done.result["status"] == "completed", done.result
    finally:
        stop(server)
    samples = await scrape(proxy)
    assert value(samples, "mcp_tasks_proxy_upstream_retries_total", reason="unsent") >= 1


async def test_a_legacy_server_that_comes_up_late_gets_the_call(make_proxy):
    port = free_port()
    proxy = await make_proxy(
        f"http://127.0.0.1:{port}/mcp", protocol="legacy", tools=[{"match": "gated", "retry": FAST}]
    )
    gate = secrets.token_hex(4)
    created = await proxy.client.call_tool("gated", {"tag": gate})
    await asyncio.sleep(0.3)
    server = subprocess.Popen([str(legacy_python()), str(ROOT / "tests" / "legacy_server.py"), str(port)])
    try:
        wait_for_port(port, server)

        async def started():
            return await tool_text(proxy, "gate_state", {"tag": gate}) == "started"

        await eventually(started, what="the call reaching the late server")
        await tool_text(proxy, "release", {"tag": gate})
        await task_reaches(proxy.client, created.result["taskId"], "completed")
        assert await tool_text(proxy, "gate_arrivals", {"tag": gate}) == "1"
    finally:
        stop(server)


async def test_an_idempotent_call_is_sent_again_after_503s_and_a_retry_after(make_proxy, fake_upstream):
    answers = [(503, {}), (429, {"Retry-After": "1"})]
    fake = await fake_upstream(_failing_then_answering(answers))
    proxy = await make_proxy(
        fake.url, protocol="modern", tools=[{"match": "lookup", "idempotent": True, "retry": {"backoff_ms": 10}}]
    )
    started = time.monotonic()
    created = await proxy.client.call_tool("lookup", {})
    done = await task_reaches(proxy.client, created.result["taskId"], "completed", "failed")
    assert done.result["status"] == "completed", done.result
    assert time.monotonic() - started >= 1.0  # the server's Retry-After, longer than the backoff, was honoured
    assert len(_tool_calls(fake)) == 3
    assert len({call["id"] for call in _tool_calls(fake)}) == 3  # each attempt a request of its own
    samples = await scrape(proxy)
    assert value(samples, "mcp_tasks_proxy_upstream_retries_total", reason="unanswered") == 2


async def test_a_call_that_may_have_run_is_not_sent_again_unless_idempotent(make_proxy, fake_upstream):
    fake = await fake_upstream(_failing_then_answering([(502, {})]))
    proxy = await make_proxy(fake.url, protocol="modern", tools=[{"match": "charge"}])
    created = await proxy.client.call_tool("charge", {})
    failed = await task_reaches(proxy.client, created.result["taskId"], "failed")
    assert "HTTP 502" in failed.result["statusMessage"]
    assert len(_tool_calls(fake)) == 1


async def test_attempts_and_the_rounds_timeout_bound_the_retries(make_proxy, fake_upstream):
    always = [(503, {})] * 100
    fake = await fake_upstream(_failing_then_answering(always))
    rules = [
        {"match": "three", "idempotent": True, "retry": {"attempts": 3, "backoff_ms": 10}},
        {"match": "slowly", "idempotent": True, "timeout_s": 1, "retry": {"attempts": 50, "backoff_ms": 10}},
    ]
    proxy = await make_proxy(fake.url, protocol="modern", tools=rules)
    three = await proxy.client.call_tool("three", {})
    failed = await task_reaches(proxy.client, three.result["taskId"], "failed")
    assert failed.result["statusMessage"].endswith("(3 attempts)"), failed.result
    assert [call["params"]["name"] for call in _tool_calls(fake)] == ["three"] * 3
    # A Retry-After past what is left of timeout_s ends the retries at once.
    fake.received.clear()
    always[:] = [(503, {"Retry-After": "30"})] * 100
    started = time.monotonic()
    slowly = await proxy.client.call_tool("slowly", {})
    failed = await task_reaches(proxy.client, slowly.result["taskId"], "failed")
    assert failed.result["statusMessage"].endswith("(1 attempt)"), failed.result
    assert time.monotonic() - started < 20


@pytest.mark.parametrize("command", [modern_command, legacy_command], ids=["2026 child", "2025 child"])
async def test_an_idempotent_call_survives_its_stdio_child_dying(make_proxy, command):
    rules = [{"match": "gated", "idempotent": True, "retry": {"attempts": 5, "backoff_ms": 100}}, {"match": "x"}]
    proxy = await stdio_proxy(make_proxy, command(), tools=rules, upstream={"stdio": {"restart_min_s": 0.2}})
    pid = int(await tool_text(proxy, "pid"))
    gate = secrets.token_hex(4)
    created = await proxy.client.call_tool("gated", {"tag": gate})
    await eventually(_started(proxy, gate), what="the call running in the child")
    os.kill(pid, signal.SIGKILL)
    # The restarted child gets the call again: it waits at the gate there.
    await eventually(_started(proxy, gate), what="the call sent again to the new child")
    assert int(await tool_text(proxy, "pid")) != pid
    await tool_text(proxy, "release", {"tag": gate})
    done = await task_reaches(proxy.client, created.result["taskId"], "completed", "failed")
    assert done.result["status"] == "completed", done.result


def _failing_then_answering(failures: list[tuple[int, dict[str, str]]]):
    """A 2026-07-28 upstream whose tools/call answers are `failures` (status, headers; a text body) in turn, then a
    result."""
    left = failures

    async def handler(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        if left:
            status, headers = left.pop(0)
            return web.Response(status=status, headers=headers, text="not now")
        result = {"resultType": "complete", "content": [{"type": "text", "text": "ok"}], "isError": False}
        return web.json_response({"jsonrpc": "2.0", "id": body["id"], "result": result})

    return handler


def _tool_calls(fake) -> list[dict]:
    return [json.loads(seen["body"]) for seen in fake.received if b'"tools/call"' in seen["body"]]


async def test_idempotent_hint_trusts_the_servers_annotations(make_proxy):
    rules = [{"match": "gated*", "idempotent": "hint", "retry": {"attempts": 5, "backoff_ms": 100}}]
    proxy = await stdio_proxy(make_proxy, modern_command(), tools=rules, upstream={"stdio": {"restart_min_s": 0.2}})
    # gated has no annotations: a call the child died in may have run, and is not sent again.
    plain_gate = secrets.token_hex(4)
    plain = await proxy.client.call_tool("gated", {"tag": plain_gate})
    await eventually(lambda: _gate_is(proxy, plain_gate, "started"), what="the plain call in the child")
    os.kill(int(await tool_text(proxy, "pid")), signal.SIGKILL)
    failed = await task_reaches(proxy.client, plain.result["taskId"], "failed")
    assert "exited" in failed.result["statusMessage"], failed.result
    # gated_idempotent says idempotentHint: true, which this rule trusts.
    gate = secrets.token_hex(4)
    hinted = await proxy.client.call_tool("gated_idempotent", {"tag": gate})
    await eventually(_started(proxy, gate), what="the hinted call in the child")
    os.kill(int(await tool_text(proxy, "pid")), signal.SIGKILL)
    await eventually(_started(proxy, gate), what="the hinted call sent again to the new child")
    await tool_text(proxy, "release", {"tag": gate})
    done = await task_reaches(proxy.client, hinted.result["taskId"], "completed", "failed")
    assert done.result["status"] == "completed", done.result


def _started(proxy, gate: str):
    """A check that the gated call waits at `gate` in the current child (none while a child restarts)."""

    async def check() -> bool:
        reply = await proxy.client.call_tool("gate_state", {"tag": gate}, tasks=False)
        return "result" in reply.message and reply.result["content"][0]["text"] == "started"

    return check


def test_retry_after_is_read_as_rfc_9110_says_and_nothing_else():
    assert retry_after_s("120") == 120.0
    assert retry_after_s(" 3 ") == 3.0
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # a date past: at once
    assert retry_after_s("99999999999999999999999") > 1e20  # honoured as a wait no round can afford
    for hostile in ("\u00b2", "-5", "1.5", "soon", "", None, "Wed, 99 Foo 2015 07:28:00 GMT", "\u0661"):
        assert retry_after_s(hostile) is None, hostile
