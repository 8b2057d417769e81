"""Bad input and broken upstreams: a clear JSON-RPC error every time, no 500, no traceback, no task left working."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json

import aiohttp
import pytest
import structlog
from aiohttp import web
from yarl import URL

from mcp_tasks_proxy.upstream.http.sse import SseParser
from tests.conftest import free_port, task_reaches
from tests.factories import headers_for, meta, request
from tests.schemas import validate, validate_error


@pytest.fixture
def front(both_fronts: str) -> str:
    """Every test here runs through both readers, the lane and aiohttp's server (tests/conftest.py)."""
    return both_fronts


MODERN = {
    "Content-Type": "application/json",
    "Accept": "application/json, text/event-stream",
    "MCP-Protocol-Version": "2026-07-28",
}


@pytest.fixture
async def proxy(make_proxy, mcp_upstream):
    return await make_proxy(mcp_upstream, tools=[{"match": "slow_*"}], limits={"max_body_bytes": 4096})


async def test_malformed_json_is_parse_error(proxy):
    for body in [b"{not json", b"", b"\xff\xfe garbage", b"[" * 3000, b"[" * 100_000]:
        reply = await proxy.client.post_raw(body, MODERN)
        assert reply.status in (400, 413)
        if reply.status == 400:
            assert reply.error["code"] == -32700
            assert reply.message["id"] is None
            validate_error(reply.message, "ParseError")


@pytest.mark.parametrize(
    "value",
    ["NaN", "-Infinity", "Infinity", "1e999", "-1e400", "1" + "0" * 400],
    ids=["nan", "minus-infinity", "infinity", "overflow", "negative-overflow", "huge-integer"],
)
async def test_numbers_that_are_not_json_are_a_parse_error_and_nothing_runs(make_proxy, fake_upstream, value):
    fake = await fake_upstream(_call_handler(jsonrpc_error))
    proxy = await make_proxy(fake.url, protocol="modern", tools=[{"match": "tasked"}])
    for tool in ("tasked", "passed_through"):
        message = request("tools/call", {"name": tool, "arguments": {"text": 1}, "_meta": meta()})
        body = json.dumps(message).replace('{"text": 1}', '{"text": ' + value + "}")
        reply = await proxy.client.post_raw(body, {**MODERN, "Mcp-Method": "tools/call", "Mcp-Name": tool})
        assert reply.status == 400, reply.body
        validate_error(reply.message, "ParseError")
        assert "not valid JSON" in reply.error["message"]
    assert not [seen for seen in fake.received if b"tools/call" in seen["body"]]


@pytest.mark.parametrize(
    "body",
    [
        '"a string"',
        "42",
        "[]",
        '{"jsonrpc": "1.0", "id": 1, "method": "tools/list"}',
        '{"jsonrpc": "2.0", "id": 1, "method": 5}',
        '{"jsonrpc": "2.0", "id": {"x": 1}, "method": "tools/list"}',
        '{"jsonrpc": "2.0", "id": true, "method": "tools/list"}',
        '{"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": "nope"}',
        '{"jsonrpc": "2.0", "id": 1}',
    ],
    ids=[
        "string",
        "number",
        "empty-batch",
        "wrong-version",
        "method-type",
        "id-object",
        "id-bool",
        "params-type",
        "no-method",
    ],
)
async def test_invalid_requests_are_minus_32600(proxy, body):
    reply = await proxy.client.post_raw(body, MODERN)
    assert reply.status == 400
    assert reply.error["code"] == -32600
    assert "Invalid request" in reply.error["message"]
    validate(reply.error, "Error", "core")


async def test_oversized_body_is_413_with_a_jsonrpc_error_naming_the_limit(proxy):
    message = request("tools/call", {"name": "slow_report", "arguments": {"topic": "x" * 10_000}, "_meta": meta()})
    reply = await proxy.client.send(message)
    assert reply.status == 413
    assert reply.error["code"] == -32600
    assert "4096 bytes" in reply.error["message"] and "max_body_bytes" in reply.error["message"]
    # The proxy still serves the next request.
    assert (await proxy.client.call("tools/list")).status == 200


async def test_unknown_task_id_is_minus_32602_for_every_method(proxy):
    for method, extra in [("tasks/get", {}), ("tasks/cancel", {}), ("tasks/update", {"inputResponses": {}})]:
        reply = await proxy.client.call(method, {"taskId": "no-such-task", **extra})
        assert reply.status == 400
        assert reply.error["code"] == -32602
        assert "unknown or has expired" in reply.error["message"]
        validate_error(reply.message, "InvalidParamsError")


@pytest.mark.parametrize(
    "method, params",
    [
        ("tasks/get", {"taskId": 123}),
        ("tasks/get", {}),
        ("tasks/cancel", {"taskId": None}),
        ("tasks/update", {"taskId": "t"}),
        ("tasks/update", {"taskId": "t", "inputResponses": []}),
    ],
    ids=["int-id", "no-id", "null-id", "no-responses", "responses-list"],
)
async def test_wrong_param_types_are_minus_32602(proxy, method, params):
    reply = await proxy.client.call(method, params)
    assert reply.status == 400
    assert reply.error["code"] == -32602
    assert "Invalid params" in reply.error["message"]


async def test_tasks_methods_need_the_extension(proxy):
    created = await proxy.client.call_tool("slow_report", {"topic": "t", "seconds": 0})
    task_id = created.result["taskId"]
    for method in ("tasks/get", "tasks/cancel"):
        reply = await proxy.client.call(method, {"taskId": task_id}, tasks=False)
        assert reply.status == 400
        validate_error(reply.message, "MissingRequiredClientCapabilityError")
        assert reply.error["data"]["requiredCapabilities"] == {"extensions": {"io.modelcontextprotocol/tasks": {}}}


@pytest.mark.parametrize("method", ["tasks/result", "tasks/list", "tasks/frobnicate"])
async def test_removed_and_unknown_tasks_methods_are_minus_32601(proxy, method):
    reply = await proxy.client.call(method, {"taskId": "x"})
    assert reply.status == 404
    validate_error(reply.message, "MethodNotFoundError")


async def test_mcp_name_header_must_match_the_task_id(proxy):
    created = await proxy.client.call_tool("slow_report", {"topic": "t", "seconds": 0})
    task_id = created.result["taskId"]
    mismatch = await proxy.client.call("tasks/get", {"taskId": task_id}, headers={"Mcp-Name": "someone-else"})
    assert mismatch.status == 400
    validate_error(mismatch.message, "HeaderMismatchError")
    assert "Mcp-Name" in mismatch.error["message"]
    # A missing Mcp-Name is accepted (one real tasks client sends none) ...
    message = request("tasks/get", {"taskId": task_id, "_meta": meta()})
    headers = {**MODERN, "Mcp-Method": "tasks/get"}
    assert (await proxy.client.post_raw(json.dumps(message), headers)).status == 200
    # ... and a Base64-encoded one is decoded before comparing.
    encoded = "=?base64?" + base64.b64encode(task_id.encode()).decode() + "?="
    assert (await proxy.client.call("tasks/get", {"taskId": task_id}, headers={"Mcp-Name": encoded})).status == 200


async def test_mcp_name_mismatch_on_a_task_call_is_rejected_before_any_task(proxy):
    reply = await proxy.client.call_tool("slow_report", {"topic": "t"}, headers={"Mcp-Name": "other_tool"})
    assert reply.status == 400
    assert reply.error["code"] == -32020


async def test_arguments_of_the_wrong_type_are_minus_32602(proxy):
    reply = await proxy.client.call("tools/call", {"name": "slow_report", "arguments": [1, 2]})
    assert reply.status == 400
    assert reply.error["code"] == -32602


# --- upstream faults ------------------------------------------------------------------------------------------------


def _call_handler(behaviour):
    """A fake upstream whose tools/call answer is `behaviour(request, body)`."""

    async def handler(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        return await behaviour(request, body)

    return handler


async def _sse(request: web.Request, *events: bytes, abort: bool = False) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for event in events:
        await response.write(event)
    if abort:
        request.transport.close()  # the upstream dies mid-stream
        return response
    await response.write_eof()
    return response


def _progress(body) -> bytes:
    token = body["params"]["_meta"].get("progressToken")
    note = {
        "jsonrpc": "2.0",
        "method": "notifications/progress",
        "params": {"progressToken": token, "progress": 1, "message": "half way"},
    }
    return f"data: {json.dumps(note)}\n\n".encode()


async def dies_mid_stream(request, body):
    return await _sse(request, _progress(body), abort=True)


async def ends_without_answer(request, body):
    return await _sse(request, _progress(body))


async def html_500(request, body):
    return web.Response(status=500, text="<html><body>Internal Server Error</body></html>", content_type="text/html")


async def garbage(request, body):
    return web.Response(status=200, body=b"\x00\x01 not json", content_type="application/json")


async def wrong_id(request, body):
    return web.json_response(
        {"jsonrpc": "2.0", "id": "someone-else", "result": {"resultType": "complete", "content": []}}
    )


async def jsonrpc_error(request, body):
    return web.json_response(
        {"jsonrpc": "2.0", "id": body["id"], "error": {"code": -32000, "message": "backend exploded"}}
    )


async def no_result_object(request, body):
    return web.json_response({"jsonrpc": "2.0", "id": body["id"], "result": "done"})


async def non_finite_number(request, body):
    # Python's json writes NaN for float("nan"); it is not JSON, and must not come out of the proxy as null.
    answer = {"jsonrpc": "2.0", "id": body["id"], "result": {"content": [], "structuredContent": {"x": float("nan")}}}
    return web.Response(body=json.dumps(answer).encode(), content_type="application/json")


@pytest.mark.parametrize(
    "behaviour, expected",
    [
        (dies_mid_stream, "connection broke"),
        (ends_without_answer, "closed its event stream before answering"),
        (html_500, "HTTP 500 text/html without a JSON-RPC response"),
        (garbage, "without a JSON-RPC response"),
        (wrong_id, "different request id"),
        (no_result_object, "no result object"),
        (non_finite_number, "without a JSON-RPC response"),
    ],
    ids=["dies-mid-stream", "ends-without-answer", "html-500", "garbage", "wrong-id", "no-result", "nan"],
)
async def test_broken_upstream_fails_the_task_with_a_clear_message(make_proxy, fake_upstream, behaviour, expected):
    fake = await fake_upstream(_call_handler(behaviour))
    proxy = await make_proxy(fake.url, protocol="modern", tools=[{"match": "*"}])
    created = await proxy.client.call_tool("job")
    failed = await task_reaches(proxy.client, created.result["taskId"], "failed", "completed")
    assert failed.result["status"] == "failed"
    validate(failed.result, "FailedTask")
    assert failed.result["error"]["code"] == -32603
    assert expected in failed.result["statusMessage"]
    assert failed.result["error"]["data"] == {"upstream": fake.url}


async def test_upstream_jsonrpc_error_is_kept_as_the_task_error(make_proxy, fake_upstream):
    fake = await fake_upstream(_call_handler(jsonrpc_error))
    proxy = await make_proxy(fake.url, protocol="modern", tools=[{"match": "*"}])
    created = await proxy.client.call_tool("job")
    failed = await task_reaches(proxy.client, created.result["taskId"], "failed")
    assert failed.result["error"] == {"code": -32000, "message": "backend exploded"}


async def test_unreachable_upstream(make_proxy):
    dead = f"http://127.0.0.1:{free_port()}/mcp"
    proxy = await make_proxy(dead, tools=[{"match": "slow_*"}])
    created = await proxy.client.call_tool("slow_report", {"topic": "t"})
    failed = await task_reaches(proxy.client, created.result["taskId"], "failed")
    assert "upstream unreachable" in failed.result["statusMessage"]
    # Pass-through to a dead upstream: a 502 with a JSON-RPC error for the same id.
    reply = await proxy.client.call("tools/list")
    assert reply.status == 502
    assert reply.error["code"] == -32603
    assert "unreachable" in reply.error["message"]
    assert reply.message["id"] is not None


async def test_passthrough_stream_that_dies_gets_an_error_event(make_proxy, fake_upstream):
    fake = await fake_upstream(_call_handler(dies_mid_stream))
    proxy = await make_proxy(fake.url, protocol="modern")
    message = request(
        "tools/call", {"name": "job", "arguments": {}, "_meta": {**meta(tasks=False), "progressToken": 9}}
    )
    reply = await proxy.client.send(message)
    assert reply.events[0]["method"] == "notifications/progress"
    assert reply.message["id"] == message["id"]
    assert reply.message["error"]["code"] == -32603
    assert "broke before the response" in reply.message["error"]["message"]


async def test_shutdown_fails_running_tasks_instead_of_leaving_them_working(make_proxy, fake_upstream):
    release = asyncio.Event()

    async def hangs(request, body):
        await release.wait()
        return web.json_response({})

    fake = await fake_upstream(_call_handler(hangs))
    proxy = await make_proxy(fake.url, protocol="modern", tools=[{"match": "*"}])
    created = await proxy.client.call_tool("job")
    from mcp_tasks_proxy.front.context import runner_key, store_key

    await proxy.app[runner_key].aclose(grace_s=0)
    record = await proxy.app[store_key].get(created.result["taskId"])
    release.set()
    assert record.status == "failed"
    assert "shut down" in record.status_message


async def slow_drip(request, body):
    """The answer arrives a few bytes at a time."""
    message = json.dumps(
        {"jsonrpc": "2.0", "id": body["id"], "result": {"content": [{"type": "text", "text": "drip"}]}}
    )
    payload = f"data: {message}\n\n".encode()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for start in range(0, len(payload), 7):
        await response.write(payload[start : start + 7])
        await asyncio.sleep(0.005)
    await response.write_eof()
    return response


async def never_ends(request, body):
    """Keep-alives forever, and never an answer."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    while True:
        await response.write(b": keep-alive\n\n")
        await asyncio.sleep(0.05)


async def test_slow_drip_is_read_to_the_end(make_proxy, fake_upstream):
    fake = await fake_upstream(_call_handler(slow_drip))
    proxy = await make_proxy(fake.url, protocol="modern", tools=[{"match": "*"}])
    created = await proxy.client.call_tool("job")
    done = await task_reaches(proxy.client, created.result["taskId"], "completed", "failed")
    assert done.result["result"]["content"][0]["text"] == "drip"
    relayed = await proxy.client.call_tool("job", tasks=False)  # and relayed as it drips, for pass-through
    assert relayed.message["result"]["content"][0]["text"] == "drip"


async def test_a_stream_that_never_ends_is_cut_by_the_rule_timeout(make_proxy, fake_upstream):
    fake = await fake_upstream(_call_handler(never_ends))
    proxy = await make_proxy(fake.url, protocol="modern", tools=[{"match": "*", "timeout_s": 0.5}])
    created = await proxy.client.call_tool("job")
    failed = await task_reaches(proxy.client, created.result["taskId"], "failed")
    assert "0.5 s limit (timeout_s)" in failed.result["statusMessage"]


# --- header bytes ---------------------------------------------------------------------------------------------------


async def raw_post(url: str, body: bytes, *header_lines: bytes) -> tuple[int, bytes]:
    """POST with header bytes no HTTP client library would send (they are not UTF-8); the status and body."""
    where = URL(url)
    reader, writer = await asyncio.open_connection(where.host, where.port)
    head = [
        f"POST {where.path} HTTP/1.1".encode(),
        f"Host: {where.host}:{where.port}".encode(),
        b"Content-Type: application/json",
        b"Accept: application/json, text/event-stream",
        f"Content-Length: {len(body)}".encode(),
        b"Connection: close",
        *header_lines,
    ]
    writer.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
    answer = await reader.read()
    writer.close()
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


@pytest.mark.parametrize(
    "header",
    [
        b"Authorization: Bearer \xff\xfe",
        b"Mcp-Session-Id: \xc3\x28",
        b"Mcp-Name: gat\xffed",
        b"MCP-Protocol-Version: 2026-07-28\xff",
        b"X-Forwarded-User: \xe9ric",
    ],
    ids=["authorization", "session", "name", "version", "principal-header"],
)
@pytest.mark.parametrize("era", ["2026", "2025-durable"])
async def test_header_bytes_that_are_not_utf8_get_a_clear_400(make_proxy, mcp_upstream, header, era):
    proxy = await make_proxy(
        mcp_upstream,
        tools=[{"match": "slow_*"}],
        security={"principal": "header"} if header.startswith(b"X-Forwarded-User") else {},
    )
    if era == "2026":
        message = request("tools/call", {"name": "slow_report", "arguments": {"topic": "t"}, "_meta": meta()})
        lines = [b"MCP-Protocol-Version: 2026-07-28", b"Mcp-Method: tools/call", b"Mcp-Name: slow_report"]
    else:
        message = request("tools/call", {"name": "slow_report", "arguments": {"topic": "t"}})
        lines = [b"MCP-Protocol-Version: 2025-11-25"]
    name = header.partition(b":")[0]
    lines = [line for line in lines if line.partition(b":")[0].lower() != name.lower()] + [header]
    with structlog.testing.capture_logs() as logs:
        status, body = await raw_post(proxy.url, json.dumps(message).encode(), *lines)
    assert status == 400, body
    answer = json.loads(body)
    validate_error(answer, "InvalidRequestError")
    assert answer["error"]["message"] == f"Invalid request: the {name.decode()} header holds bytes that are not UTF-8"
    assert [line for line in logs if line["log_level"] in ("error", "critical") or "exc_info" in line] == []
    assert [line["status"] for line in logs if line["event"] == "request_handled"] == [400]


async def test_other_header_bytes_pass_through_as_sent(make_proxy, fake_upstream):
    async def answer(request):
        return web.json_response({"jsonrpc": "2.0", "id": 1, "result": {"tools": []}})

    fake = await fake_upstream(answer)
    proxy = await make_proxy(fake.url, protocol="legacy")
    message = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    status, body = await raw_post(proxy.url, json.dumps(message).encode(), b"X-Note: caf\xe9 \xff")
    assert status == 200, body
    assert json.loads(body)["result"] == {"tools": []}
    (seen,) = [seen for seen in fake.received if b"tools/list" in seen["body"]]
    assert seen["headers"]["X-Note"].encode("utf-8", "surrogateescape") == b"caf\xe9 \xff"


async def wrong_id_duplicate(request, body):
    # Another request's answer, as the SDKs write one: a late duplicate on a pooled connection looks like this.
    answer = {"jsonrpc": "2.0", "id": "someone-else", "result": {"content": [{"type": "text", "text": "not yours"}]}}
    return web.Response(body=json.dumps(answer, separators=(",", ":")).encode(), content_type="application/json")


@pytest.mark.parametrize("era", ["2026 (lane)", "2025 (aiohttp)"])
async def test_a_relayed_answer_to_another_request_id_is_refused_as_an_upstream_failure(make_proxy, fake_upstream, era):
    fake = await fake_upstream(_call_handler(wrong_id_duplicate))
    proxy = await make_proxy(fake.url, protocol="modern")
    message = request("tools/call", {"name": "job", "arguments": {}, "_meta": meta(tasks=False)})
    headers = headers_for(message) if era.startswith("2026") else {"Content-Type": "application/json",
        "Accept": "application/json, text/event-stream", "MCP-Protocol-Version": "2025-11-25"}  # fmt: skip
    if not era.startswith("2026"):
        del message["params"]["_meta"]
    reply = await proxy.client.post_raw(json.dumps(message), headers)
    assert reply.status == 502 and reply.message["id"] == message["id"], reply.message
    assert reply.error["code"] == -32603 and "different request id" in reply.error["message"]
    assert b"not yours" not in reply.body


def _answer_bytes(request_id, *, text: str = "not yours", result_first: bool = False) -> bytes:
    """A JSON-RPC answer as an SDK writes it; `result_first` as the TypeScript SDK orders it (the id last)."""
    result = {"content": [{"type": "text", "text": text}]}
    answer = {"result": result, "jsonrpc": "2.0", "id": request_id} if result_first else {
        "jsonrpc": "2.0", "id": request_id, "result": result}  # fmt: skip
    return json.dumps(answer, separators=(",", ":")).encode()


async def _chunked_json(request, body):
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    response.enable_chunked_encoding()
    await response.prepare(request)
    await response.write(_answer_bytes("someone-else"))
    await response.write_eof()
    return response


async def _gzip_json(request, body):
    import gzip

    return web.Response(body=gzip.compress(_answer_bytes("someone-else")), content_type="application/json",
                        headers={"Content-Encoding": "gzip"})  # fmt: skip


async def _batch_json(request, body):
    batch = b"[" + _answer_bytes(body["id"]) + b"]"
    return web.Response(body=batch, content_type="application/json")


async def _sse_foreign(request, body):
    progress = {"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progressToken": 1, "progress": 1}}
    return await _sse(request, b"data: " + json.dumps(progress).encode() + b"\n\n",
                      b"event: message\ndata: " + _answer_bytes("someone-else") + b"\n\n")  # fmt: skip


@pytest.mark.parametrize("shape", ["chunked", "gzip", "batch", "event-stream"])
async def test_an_answer_to_another_request_is_refused_whatever_its_framing(make_proxy, fake_upstream, shape):
    behaviour = {"chunked": _chunked_json, "gzip": _gzip_json, "batch": _batch_json, "event-stream": _sse_foreign}
    fake = await fake_upstream(_call_handler(behaviour[shape]))
    proxy = await make_proxy(fake.url, protocol="modern")
    message = request("tools/call", {"name": "job", "arguments": {}, "_meta": meta(tasks=False)})
    headers = {**headers_for(message), "Accept-Encoding": "gzip"}
    reply = await proxy.client.post_raw(json.dumps(message), headers)
    assert b"not yours" not in reply.body and b"someone-else" not in reply.body, reply.body
    if shape == "event-stream":  # the head went by with the progress: the stream ends with an error for this id
        (error,) = [event for event in reply.events if "error" in event]
        assert error["id"] == message["id"] and "different request id" in error["error"]["message"]
        return
    assert reply.status == 502, (reply.status, reply.body)
    assert reply.message["id"] == message["id"] and reply.error["code"] == -32603
    assert ("a batch" if shape == "batch" else "different request id") in reply.error["message"]


@pytest.mark.parametrize("ours", [True, False])
async def test_a_large_answer_streams_and_never_arrives_whole_when_it_is_another_requests(
    make_proxy, fake_upstream, ours
):
    """Past 256 KiB an answer streams (memory stays bounded); its id is checked as it goes, the last piece held
    until the check ends: another request's answer reaches the client broken, never whole. The TypeScript SDK
    writes the id last."""

    async def large(request, body):
        answer = _answer_bytes(body["id"] if ours else "someone-else", text="x" * 400_000, result_first=True)
        return web.Response(body=answer, content_type="application/json")

    fake = await fake_upstream(_call_handler(large))
    proxy = await make_proxy(fake.url, protocol="modern")
    message = request("tools/call", {"name": "job", "arguments": {}, "_meta": meta(tasks=False)})
    async with proxy.client.session.post(proxy.url, data=json.dumps(message), headers=headers_for(message),
                                         expect100=proxy.client.expect100) as response:  # fmt: skip
        assert response.status == 200
        if ours:
            assert json.loads(await response.read())["id"] == message["id"]
            return
        with pytest.raises(aiohttp.ClientPayloadError):
            await response.read()


async def test_a_stream_cut_mid_event_ends_with_an_error_event_a_client_can_read(make_proxy, fake_upstream):
    async def cut(request, body):
        return await _sse(request, b'event: message\ndata: {"jsonrpc":"2.0","id":', abort=True)

    fake = await fake_upstream(_call_handler(cut))
    proxy = await make_proxy(fake.url, protocol="modern")
    message = request("tools/call", {"name": "job", "arguments": {}, "_meta": meta(tasks=False)})
    async with proxy.client.session.post(proxy.url, data=json.dumps(message), headers=headers_for(message),
                                         expect100=proxy.client.expect100) as response:  # fmt: skip
        raw = await response.read()
    # As a client's SSE parser reads it: the cut event ends as one (its data is not JSON), then the error event.
    readable = []
    for event in SseParser().feed(raw):
        with contextlib.suppress(ValueError):
            readable.append(json.loads(event.data))
    errors = [event for event in readable if "error" in event]
    assert len(errors) == 1 and errors[0]["id"] == message["id"], raw
    assert "broke before the response" in errors[0]["error"]["message"]


async def test_the_suite_reaches_the_reader_it_names(make_proxy, mcp_upstream, front):
    """The check that this module's `front` runs what it says: the lane relays the call, or aiohttp reads it."""
    from tests.test_lane import lane_counts

    proxy = await make_proxy(mcp_upstream, protocol="modern")  # the era known from the start: the lane relays
    assert (await proxy.client.call_tool("add", {"a": 1, "b": 2}, tasks=False)).result["structuredContent"]
    counts = lane_counts(proxy)
    if front == "lane":
        assert counts["relayed"] == 1 and counts["handed_over"] == 0, counts
    else:
        assert counts["relayed"] == 0 and counts["served"] == 0 and counts["handed_over"] == 1, counts
