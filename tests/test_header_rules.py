"""SEP-2243 routing headers: what the proxy answers itself, and what it forwards to a legacy upstream (which cannot
check them), is refused with -32020 / HTTP 400 when `Mcp-Method` or `Mcp-Name` disagrees with the body."""

from __future__ import annotations

import base64
import json
import secrets

import pytest
from aiohttp import web
from multidict import CIMultiDict

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


async def send_with_copies(proxy, message, name: str, *copies: str):
    """The message with its usual headers, `name` replaced by several copies (as a client may send them)."""
    headers = CIMultiDict(headers_for(message))
    headers.popall(name, None)
    for value in copies:
        headers.add(name, value)
    async with proxy.client.session.post(proxy.url, data=json.dumps(message), headers=headers) as response:
        return response.status, await response.json()


@pytest.mark.parametrize("tasks", [True, False], ids=["task", "synchronous"])
@pytest.mark.parametrize(
    ("name", "copies"),
    [("Mcp-Method", ("tools/call", "tasks/get")), ("Mcp-Name", ("gated", "ask_name"))],
    ids=["method", "name"],
)
async def test_a_true_first_copy_and_a_lying_second_one_run_nowhere(proxy, legacy_upstream, tasks, name, copies):
    tag = secrets.token_hex(6)
    message = request("tools/call", {"name": "gated", "arguments": {"tag": tag}, "_meta": meta(tasks=tasks)})
    for order in (copies, copies[::-1]):
        status, answer = await send_with_copies(proxy, message, name, *order)
        assert status == 400, answer
        validate_error(answer, "HeaderMismatchError")
        assert repr(copies[1]) in answer["error"]["message"]
    assert await gate_state(proxy, legacy_upstream, tag) == "unknown"
    # Copies that agree with the body are no lie.
    if tasks:
        status, answer = await send_with_copies(proxy, message, name, copies[0], copies[0])
        assert status == 200 and answer["result"]["status"] == "working", answer
        assert (await proxy.client.cancel_task(answer["result"]["taskId"])).status == 200
    else:
        add = request("tools/call", {"name": "add", "arguments": {"a": 1, "b": 2}, "_meta": meta(tasks=False)})
        value = headers_for(add)[name]
        status, answer = await send_with_copies(proxy, add, name, value, value)
        assert status == 200 and answer["result"]["content"][0]["text"] == "3", answer


async def test_mcp_name_in_base64_must_be_canonical(proxy, legacy_upstream):
    tag = secrets.token_hex(6)
    message = request("tools/call", {"name": "gated", "arguments": {"tag": tag}, "_meta": meta()})
    canonical = base64.b64encode(b"gated").decode()
    assert canonical == "Z2F0ZWQ="
    # "Z2F0ZWR=" decodes to the same bytes with a lenient decoder (its padding bits are set): another spelling.
    for lenient in ("=?base64?Z2F0ZWR=?=", "=?base64?Z2F0ZWQ?=", "=?base64?Z2F0 ZWQ=?=", "=?base64?Z2F0ZWQ=é?="):
        reply = await send(proxy, message, **{"Mcp-Name": lenient.encode().decode("latin-1")})
        assert reply.status == 400, (lenient, reply.body)
        validate_error(reply.message, "HeaderMismatchError")
    assert await gate_state(proxy, legacy_upstream, tag) == "unknown"
    created = await send(proxy, message, **{"Mcp-Name": f"=?base64?{canonical}?="})
    assert created.status == 200 and created.result["status"] == "working", created.body
    await proxy.client.cancel_task(created.result["taskId"])


async def test_notifications_and_batches_are_checked_like_requests(make_proxy, fake_upstream):
    async def answer(request):
        return web.Response(status=202)

    fake = await fake_upstream(answer)
    proxy = await make_proxy(fake.url, protocol="legacy")
    cancelled = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 1}}
    progress = {"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progressToken": 1, "progress": 1}}
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    for body, method in (
        (cancelled, "tools/call"),
        ([cancelled, progress], "notifications/cancelled"),
        ([request("tools/list", {}), request("tools/call", {"name": "x"})], "tools/list"),
    ):
        reply = await proxy.client.post_raw(json.dumps(body), {**headers, "Mcp-Method": method})
        assert reply.status == 400, reply.body
        validate_error(reply.message, "HeaderMismatchError")
    assert fake.received == []
    truthful = await proxy.client.post_raw(json.dumps(cancelled), {**headers, "Mcp-Method": "notifications/cancelled"})
    assert truthful.status == 202
    assert [json.loads(seen["body"]) for seen in fake.received] == [cancelled]


def test_a_batch_is_checked_against_header_copies_that_agree_once_per_item_not_once_per_copy(monkeypatch):
    """A head may hold about 128 copies of a routing header and a batch hundreds of thousands of items: copies
    that agree are judged once, and each item compared with what they say (a batch of 91,000 calls under 119
    copies took 7.9 s when every copy was decoded for every item). Copies that disagree still fail the first item."""
    from multidict import CIMultiDict

    from mcp_tasks_proxy.clients import envelope
    from mcp_tasks_proxy.clients.envelope import check_batch_routing_headers
    from mcp_tasks_proxy.jsonrpc import HEADER_MISMATCH, JsonRpcError

    decoded = []
    real = envelope.decode_header_value
    monkeypatch.setattr(envelope, "decode_header_value", lambda value: decoded.append(value) or real(value))
    calls = [request("tools/call", {"name": "a"}) for _ in range(1000)]
    copies = CIMultiDict([("Mcp-Method", "tools/call")] * 100 + [("Mcp-Name", "=?base64?YQ==?=")] * 100)
    check_batch_routing_headers(calls, copies)
    assert len(decoded) <= 100 + 1000  # was 100 x 1000
    for batch, headers, says in (
        (calls + [request("tools/call", {"name": "b"})], copies, "'b'"),  # an item that disagrees with the copies
        (calls, CIMultiDict([("Mcp-Method", "tools/call"), ("Mcp-Method", "tools/list")]), "'tools/call'"),
        (calls, CIMultiDict([("Mcp-Name", "=?base64?YJ==?=")] * 3), "not canonical"),
    ):
        with pytest.raises(JsonRpcError) as refused:
            check_batch_routing_headers(batch, headers)
        assert refused.value.code == HEADER_MISMATCH and says in refused.value.message, refused.value.message
