"""SEP-2243 routing headers: what the proxy answers itself, and what it forwards to a legacy upstream (which cannot
check them), is refused with -32020 / HTTP 400 when `Mcp-Method` or `Mcp-Name` disagrees with the body."""

from __future__ import annotations

import base64
import json
import secrets

import pytest

from tests.conftest import LegacyClient
from tests.factories import headers_for, meta, request
from tests.schemas import validate_error


@pytest.fixture
async def proxy(make_proxy, legacy_upstream):
    rules = [{"match": "gated", "task": "optional"}, {"match": "ask_*", "task": "optional"}]
    return await make_proxy(legacy_upstream, tools=rules, tasks={"poll_interval_ms": 50})


async def send(proxy, message, **header_changes):
    headers = {**headers_for(message), **header_changes}
    for name in [name for name, value in header_changes.items() if value is None]:
        del headers[name]
    return await proxy.client.post_raw(json.dumps(message), headers)


def assert_mismatch(reply, *values):
    assert reply.status == 400, reply.body
    validate_error(reply.message, "HeaderMismatchError")
    for value in values:
        assert repr(value) in reply.error["message"], reply.error["message"]


async def gate_state(proxy, legacy_upstream, tag):
    """What the legacy server saw of a gated(tag) call, asked of the server directly."""
    return await LegacyClient(proxy.client.session, legacy_upstream).call_tool("gate_state", {"tag": tag})


@pytest.mark.parametrize("tasks", [True, False], ids=["task", "synchronous"])
async def test_a_tools_call_that_says_it_is_another_method_runs_nowhere(proxy, legacy_upstream, tasks):
    tag = secrets.token_hex(6)
    message = request("tools/call", {"name": "gated", "arguments": {"tag": tag}, "_meta": meta(tasks=tasks)})
    reply = await send(proxy, message, **{"Mcp-Method": "tasks/get"})
    assert_mismatch(reply, "tasks/get", "tools/call")
    assert await gate_state(proxy, legacy_upstream, tag) == "unknown"


@pytest.mark.parametrize("tasks", [True, False], ids=["task", "synchronous"])
async def test_a_tools_call_named_for_another_tool_runs_nowhere(proxy, legacy_upstream, tasks):
    tag = secrets.token_hex(6)
    message = request("tools/call", {"name": "gated", "arguments": {"tag": tag}, "_meta": meta(tasks=tasks)})
    assert_mismatch(await send(proxy, message, **{"Mcp-Name": "not-the-tool"}), "not-the-tool", "gated")
    # A 2026 client must send Mcp-Name on tools/call: a missing one is refused as the reference server does.
    assert_mismatch(await send(proxy, message, **{"Mcp-Name": None}), "gated")
    assert await gate_state(proxy, legacy_upstream, tag) == "unknown"


async def test_tasks_get_that_says_it_is_a_tools_call_is_refused(proxy):
    created = await proxy.client.call_tool("gated", {"tag": secrets.token_hex(6)})
    task_id = created.result["taskId"]
    message = request("tasks/get", {"taskId": task_id, "_meta": meta()})
    assert_mismatch(await send(proxy, message, **{"Mcp-Method": "tools/call"}), "tools/call", "tasks/get")
    assert_mismatch(await send(proxy, message, **{"Mcp-Method": None}), "tasks/get")
    # Mcp-Name stays optional on tasks/* (fastmcp-tasks omits it); present, it must name the task, maybe in Base64.
    assert (await send(proxy, message, **{"Mcp-Name": None})).status == 200
    encoded = "=?base64?" + base64.b64encode(task_id.encode()).decode() + "?="
    assert (await send(proxy, message, **{"Mcp-Name": encoded})).status == 200
    lie = "=?base64?bm90LWl0?="  # "not-it"
    assert_mismatch(await send(proxy, message, **{"Mcp-Name": lie}), lie, task_id)
    cancel = request("tasks/cancel", {"taskId": task_id, "_meta": meta()})
    assert_mismatch(await send(proxy, cancel, **{"Mcp-Method": "tasks/get"}), "tasks/get", "tasks/cancel")
    assert (await proxy.client.get_task(task_id)).result["status"] == "working"
    assert (await proxy.client.cancel_task(task_id)).status == 200


@pytest.mark.parametrize(
    ("method", "params", "wrong_name"),
    [
        ("prompts/get", {"name": "greeting", "arguments": {"name": "x"}}, "other-prompt"),
        ("resources/read", {"uri": "note://greeting"}, "note://other"),
    ],
)
async def test_prompts_and_resources_relayed_to_a_legacy_upstream_are_checked(proxy, method, params, wrong_name):
    message = request(method, {**params, "_meta": meta(tasks=False)})
    body_value = params.get("name", params.get("uri"))
    assert_mismatch(await send(proxy, message, **{"Mcp-Name": wrong_name}), wrong_name, body_value)
    assert_mismatch(await send(proxy, message, **{"Mcp-Method": "tools/list"}), "tools/list", method)
    answered = await send(proxy, message)
    assert answered.status == 200 and "result" in answered.message, answered.message


async def test_a_2026_list_request_without_its_method_header_is_refused(proxy):
    message = request("tools/list", {"_meta": meta(tasks=False)})
    assert_mismatch(await send(proxy, message, **{"Mcp-Method": None}), "tools/list")
    assert_mismatch(await send(proxy, message, **{"MCP-Protocol-Version": None}), "2026-07-28")
    assert (await send(proxy, message)).status == 200


async def test_a_legacy_clients_routing_headers_must_not_contradict_its_body(proxy, legacy_upstream):
    """A legacy client's request is forwarded untouched, but headers a gateway may route on must not lie."""
    client = LegacyClient(proxy.client.session, proxy.url)
    assert await client.call_tool("add", {"a": 1, "b": 2}) == "3"  # opens its session through the proxy
    tag = secrets.token_hex(6)
    message = {
        "jsonrpc": "2.0",
        "id": 7,
        "method": "tools/call",
        "params": {"name": "gated", "arguments": {"tag": tag}},
    }
    for lie in ({"Mcp-Method": "tasks/get"}, {"Mcp-Name": "not-the-tool"}):
        reply = await proxy.client.post_raw(json.dumps(message), {**client.headers, **lie})
        assert_mismatch(reply, next(iter(lie.values())))
    # Without those headers (as legacy clients send it) it passes through and runs.
    truthful = {
        "jsonrpc": "2.0",
        "id": 8,
        "method": "tools/call",
        "params": {"name": "add", "arguments": {"a": 2, "b": 2}},
    }
    reply = await proxy.client.post_raw(json.dumps(truthful), {**client.headers, "Mcp-Method": "tools/call"})
    assert reply.status == 200 and reply.message["result"]["content"][0]["text"] == "4"
    assert await gate_state(proxy, legacy_upstream, tag) == "unknown"
