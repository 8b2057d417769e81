"""A stop (SIGTERM) while everything a client may hold open is open: a running task, a subscriptions/listen stream
on it, and a kept-alive call. The proxy ends each as the spec says and exits cleanly, within the tasks' grace rather
than after the connections' grace too; many times over, as the failure it fixes came one stop in five."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import aiohttp
import pytest

from mcp_tasks_proxy.front.serve import SHUTDOWN_TIMEOUT_S
from tests.conftest import PROXY, ROOT, free_port, stop, wait_for_port, wait_ready

GRACE_S = 2
TASKS = {"extensions": {"io.modelcontextprotocol/tasks": {}}}


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    port = free_port()
    server = subprocess.Popen([sys.executable, str(ROOT / "examples" / "slow_server.py"), str(port)])
    try:
        wait_for_port(port, server)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        stop(server)


def body(request_id: int, method: str, params: dict, capabilities: dict) -> dict:
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientCapabilities": capabilities}  # fmt: skip
    return {"jsonrpc": "2.0", "id": request_id, "method": method, "params": {**params, "_meta": meta}}


def headers(method: str, name: str | None = None) -> dict[str, str]:
    sent = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream",
            "MCP-Protocol-Version": "2026-07-28", "Mcp-Method": method}  # fmt: skip
    return sent | ({"Mcp-Name": name} if name else {})


async def events(response: aiohttp.ClientResponse) -> list[dict]:
    """Every JSON-RPC message of an SSE response, to its end."""
    messages = []
    async for line in response.content:
        if line.startswith(b"data:"):
            messages.append(json.loads(line[5:]))
    return messages


async def one_stop(server_url: str, tmp_path) -> tuple[int, float, str, list[dict], list[dict]]:
    policy = tmp_path / "policy.yaml"
    policy.write_text(f'tasks:\n  shutdown_grace_s: {GRACE_S}\ntools:\n  - match: "slow_*"\n')
    port = free_port()
    proxy = subprocess.Popen([*PROXY, "--config", str(policy), "--upstream", server_url, "--port", str(port),
                              "--log-format", "json"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        wait_for_port(port, proxy)
        await asyncio.to_thread(wait_ready, port)
        url = f"http://127.0.0.1:{port}/mcp"
        arguments = {"name": "slow_report", "arguments": {"topic": "tides", "seconds": 60}}
        async with aiohttp.ClientSession() as session:
            created = await session.post(url, json=body(1, "tools/call", arguments, TASKS),
                                         headers=headers("tools/call", "slow_report"))  # fmt: skip
            task_id = (await created.json())["result"]["taskId"]
            listen = await session.post(
                url,
                json=body(2, "subscriptions/listen", {"notifications": {"taskIds": [task_id]}}, TASKS),
                headers=headers("subscriptions/listen"),
            )
            kept = await session.post(url, json=body(3, "tools/call", arguments, {}),
                                      headers=headers("tools/call", "slow_report"))  # fmt: skip
            assert kept.headers["Content-Type"].startswith("text/event-stream")  # the kept-alive call's stream
            listened, answered = asyncio.ensure_future(events(listen)), asyncio.ensure_future(events(kept))
            await asyncio.sleep(0.5)
            started = time.monotonic()
            proxy.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(proxy.wait, 60)
            took = time.monotonic() - started
            listen_messages, kept_messages = await listened, await answered
    finally:
        stop(proxy)
    assert proxy.stdout is not None
    output = proxy.stdout.read().decode()
    proxy.stdout.close()
    return code, took, output, listen_messages, kept_messages


@pytest.mark.parametrize("attempt", range(3))
async def test_a_stop_with_a_task_a_listen_stream_and_a_kept_alive_call_open_is_clean(server_url, tmp_path, attempt):
    code, took, output, listened, kept = await one_stop(server_url, tmp_path)
    assert code == 0
    for said in ("Task was destroyed", "Event loop is closed", "Traceback", '"level":"error"'):
        assert said not in output, output[-3000:]
    # The listen stream: its acknowledgement, the task's state, and at the stop the subscription's result.
    assert listened[0]["method"] == "notifications/subscriptions/acknowledged"
    assert listened[-1]["id"] == 2 and listened[-1]["result"]["resultType"] == "complete"
    # The kept-alive call: answered with what became of its call, failed at the stop (a 60 s tool, a 2 s grace).
    assert kept[-1]["id"] == 3 and "error" in kept[-1], kept[-1]
    # The tasks' grace, not the connections' grace after it (which is what waited before).
    assert took < SHUTDOWN_TIMEOUT_S, took
    lines = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    drained = next(line for line in lines if line["event"] == "tasks_drained")
    assert drained["failed_at_shutdown"] == 2
