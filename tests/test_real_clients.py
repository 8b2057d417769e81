"""Real clients, real timeouts: each official client calls a tool several times longer than a middlebox between it
and the proxy lets a connection idle or stay open. Through the proxy the call completes; straight to the server,
through the same middlebox, it dies (that is the point)."""

from __future__ import annotations

import asyncio
import functools
import json
import sys
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import pytest

from tests.conftest import EVERYTHING, ROOT, everything_node, legacy_python, task_reaches
from tests.factories import McpClient
from tests.middlebox import Middlebox

SDK1_CLIENT = ROOT / "tests" / "clients" / "sdk1_client.py"
CALL_S = 5.0
"""How long the tool works: several times the middlebox's limits below."""


@pytest.fixture
async def middlebox():
    boxes: list[Middlebox] = []

    async def build(url: str, **limits: float) -> tuple[str, Middlebox]:
        parts = urlsplit(url)
        box = Middlebox(parts.port, **limits)
        boxes.append(box)
        port = await box.start()
        return f"http://127.0.0.1:{port}{parts.path}", box

    yield build
    for box in boxes:
        await box.close()


async def run_client(*argv: str, timeout_s: float) -> dict:
    process = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout=timeout_s + 30)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    lines = out.decode().strip().splitlines()
    assert lines, err.decode()[-2000:]
    print(f"\n{Path(argv[1]).name} {argv[2]} -> {lines[-1]}")  # shown with pytest -s: what each client got
    return json.loads(lines[-1])


async def sdk1_call(url: str, tool: str, arguments: dict, *flags: str, timeout_s: float = 20.0) -> dict:
    python = str(legacy_python())
    argv = [python, str(SDK1_CLIENT), url, tool, json.dumps(arguments), str(timeout_s), *flags]
    return await run_client(*argv, timeout_s=timeout_s)


async def saved_by_the_proxy(call, proxy_url: str, upstream_url: str, middlebox, **limits: float) -> None:
    """`call(url, timeout_s=...)` completes through the proxy, and dies straight to the server through the same
    middlebox (which cut at least one of its connections)."""
    url, _ = await middlebox(proxy_url, **limits)
    assert await call(url) == {"text": f"quiet for {CALL_S:g} s", "isError": False}
    straight, straight_box = await middlebox(upstream_url, **limits)
    died = await call(straight, timeout_s=CALL_S + 4)
    assert "failed" in died, died
    assert straight_box.cuts >= 1


@pytest.fixture
async def proxy(make_proxy, plain_legacy_upstream):
    rules = [{"match": "quiet", "keepalive_s": 0.5, "max_stream_s": 1.5}]
    return await make_proxy(plain_legacy_upstream, tools=rules)


@pytest.mark.parametrize("limits", [{"idle_s": 1.5}, {"max_open_s": 2.0}], ids=["idle-cut", "open-too-long-cut"])
async def test_python_sdk_1x_client_survives_a_middlebox_through_the_proxy(
    proxy, plain_legacy_upstream, middlebox, limits
):
    call = functools.partial(sdk1_call, tool="quiet", arguments={"seconds": CALL_S})
    await saved_by_the_proxy(call, proxy.url, plain_legacy_upstream, middlebox, **limits)


SDK2_CLIENT = ROOT / "tests" / "clients" / "sdk2_client.py"


async def sdk2_call(url: str, tool: str, arguments: dict, *, timeout_s: float = 20.0) -> dict:
    return await run_client(
        sys.executable, str(SDK2_CLIENT), url, tool, json.dumps(arguments), str(timeout_s), timeout_s=timeout_s
    )


@pytest.mark.parametrize("era", ["modern", "legacy"])
async def test_python_sdk_2x_client_without_tasks_survives_an_idle_cut_through_the_proxy(
    make_proxy, mcp_upstream, plain_legacy_upstream, middlebox, era
):
    upstream = mcp_upstream if era == "modern" else plain_legacy_upstream
    proxy = await make_proxy(upstream, tools=[{"match": "quiet", "keepalive_s": 0.5}])
    call = functools.partial(sdk2_call, tool="quiet", arguments={"seconds": CALL_S})
    await saved_by_the_proxy(call, proxy.url, upstream, middlebox, idle_s=1.5)


async def test_a_2026_client_with_tasks_survives_both_cuts_by_polling(make_proxy, mcp_upstream, middlebox):
    """The tasks extension needs nothing kept open: every request is short, whatever cuts the connections."""
    proxy = await make_proxy(mcp_upstream, tools=[{"match": "quiet"}], tasks={"poll_interval_ms": 200})
    url, _ = await middlebox(proxy.url, idle_s=1.5, max_open_s=2.0)
    # A connection per request: one kept alive across polls would itself outlive max_open_s and be cut mid-request.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        client = McpClient(session, url)
        created = await client.call_tool("quiet", {"seconds": CALL_S})
        assert created.result["resultType"] == "task"
        done = await task_reaches(client, created.result["taskId"], "completed")
    assert done.result["result"]["content"][0]["text"] == f"quiet for {CALL_S:g} s"


async def ts_call(url: str, tool: str, arguments: dict, *, timeout_s: float = 20.0) -> dict:
    script = EVERYTHING / "ts_sdk_client.mjs"
    node = str(everything_node())
    return await run_client(node, str(script), url, tool, json.dumps(arguments), str(timeout_s), timeout_s=timeout_s)


@pytest.mark.parametrize("limits", [{"idle_s": 1.5}, {"max_open_s": 2.0}], ids=["idle-cut", "open-too-long-cut"])
async def test_typescript_sdk_1x_client_survives_a_middlebox_through_the_proxy(
    proxy, plain_legacy_upstream, middlebox, limits
):
    call = functools.partial(ts_call, tool="quiet", arguments={"seconds": CALL_S})
    await saved_by_the_proxy(call, proxy.url, plain_legacy_upstream, middlebox, **limits)


@pytest.mark.parametrize("limits", [{"idle_s": 1.5}, {"max_open_s": 2.0}], ids=["idle-cut", "open-too-long-cut"])
async def test_a_sep_1686_client_gets_the_proxys_tasks_and_survives_a_middlebox(
    proxy, plain_legacy_upstream, middlebox, limits
):
    """The Python SDK 1.x client's experimental task API: call_tool_as_task, poll_task, get_task_result. Straight to
    the server it finds no tasks at all (the server has none); through the proxy every request is short.

    A connection per request, as for the 2026 client above: the SDK's pooled connection, opened for one poll, would be
    reused for the next just as the middlebox cuts it (pollInterval 2 s, max_open_s 2 s), and the poll lost on the way
    would end the SDK 1.x client's session (tests/clients/sdk1_client.py)."""
    url, box = await middlebox(proxy.url, **limits)
    outcome = await sdk1_call(url, "quiet", {"seconds": CALL_S}, "--as-task", "--connection-per-request")
    assert outcome == {"text": f"quiet for {CALL_S:g} s", "isError": False, "statuses": ["completed"]}
    assert box.cuts >= 1  # its standalone GET stream, at least: what the client survived

    straight, _ = await middlebox(plain_legacy_upstream, **limits)
    refused = await sdk1_call(straight, "quiet", {"seconds": CALL_S}, "--as-task")
    assert refused == {"failed": "the server declares no tasks capability"}
