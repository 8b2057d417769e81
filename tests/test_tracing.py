"""OpenTelemetry tracing (the `otel` extra): spans for requests, tasks and upstream calls, trace context continued
from the client and passed upstream; checked with the SDK's in-memory exporter, and once over OTLP/HTTP to a
receiver of this test's own (the proxy as a real process, configured by the standard OTEL_* variables)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from mcp_tasks_proxy import tracing
from tests.conftest import ROOT, eventually, free_port, stop, task_reaches, wait_for_port
from tests.factories import McpClient, meta
from tests.test_lane import lane_counts

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
SECRET = "zebra-secret-topic-41"  # an argument: it must appear in no span
RULES = [{"match": name} for name in ("slow_report", "one_question", "gated", "protocol_error_job")]


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(tracing.Tracer(provider))
    try:
        yield exporter
    finally:
        tracing.install(tracing._Off())
        provider.shutdown()


def hex_trace(span) -> str:
    return format(span.context.trace_id, "032x")


def named(exporter, name: str) -> list:
    return [span for span in exporter.get_finished_spans() if span.name == name]


def no_secrets(exporter) -> None:
    for span in exporter.get_finished_spans():
        assert SECRET not in json.dumps(dict(span.attributes or {})), span.name
        assert "Report on" not in json.dumps(dict(span.attributes or {})), span.name


async def test_a_task_is_one_span_from_creation_to_completion_with_its_requests_linked(make_proxy, mcp_upstream, spans):
    proxy = await make_proxy(mcp_upstream, tools=RULES)
    traced = {"traceparent": TRACEPARENT}
    created = await proxy.client.call_tool("slow_report", {"topic": SECRET, "seconds": 0}, headers=traced)
    task_id = created.result["taskId"]
    await task_reaches(proxy.client, task_id, "completed")

    (create,) = [s for s in named(spans, "tools/call slow_report") if s.kind is SpanKind.SERVER]
    assert hex_trace(create) == CLIENT_TRACE and format(create.parent.span_id, "016x") == CLIENT_SPAN  # continued
    assert create.attributes["mcp.method.name"] == "tools/call"
    assert create.attributes["gen_ai.tool.name"] == "slow_report"
    assert create.attributes["mcp.task.id"] == task_id
    (task,) = named(spans, "task slow_report")
    assert task.parent.span_id == create.context.span_id and hex_trace(task) == CLIENT_TRACE
    assert task.attributes["mcp.task.id"] == task_id and task.attributes["mcp.task.status"] == "completed"
    (upstream,) = [s for s in named(spans, "tools/call slow_report") if s.kind is SpanKind.CLIENT]
    assert upstream.parent.span_id == task.context.span_id  # the upstream call is the task's child
    polls = named(spans, "tasks/get")
    assert polls and all(hex_trace(poll) != CLIENT_TRACE for poll in polls)  # polls start their own traces...
    for poll in polls:  # ...linked to the task's span
        assert [link.context.span_id for link in poll.links] == [task.context.span_id]
        assert poll.attributes["mcp.task.id"] == task_id
    no_secrets(spans)
    # Served by the lane, as without tracing: turning tracing on moves no traffic onto other code.
    assert lane_counts(proxy)["served"] >= 2 and lane_counts(proxy)["handled"] == 0


async def test_update_and_cancel_link_to_the_task_and_a_failure_is_an_error(make_proxy, mcp_upstream, spans):
    proxy = await make_proxy(mcp_upstream, tools=RULES)
    params = {"name": "one_question", "arguments": {}, "_meta": meta(elicitation={})}
    task_id = (await proxy.client.call("tools/call", params)).result["taskId"]
    pending = await task_reaches(proxy.client, task_id, "input_required")
    (key,) = pending.result["inputRequests"]
    await proxy.client.call("tasks/update", {"taskId": task_id, "inputResponses": {key: {"action": "accept",
                            "content": {"answer": SECRET}}}})  # fmt: skip
    await task_reaches(proxy.client, task_id, "completed")
    (task,) = named(spans, "task one_question")
    (update,) = named(spans, "tasks/update")
    assert [link.context.span_id for link in update.links] == [task.context.span_id]

    gated = await proxy.client.call_tool("gated", {"tag": "never-released"})
    await proxy.client.cancel_task(gated.result["taskId"])
    await task_reaches(proxy.client, gated.result["taskId"], "cancelled")
    (cancelled,) = named(spans, "task gated")
    assert cancelled.attributes["mcp.task.status"] == "cancelled"
    (cancel,) = named(spans, "tasks/cancel")
    assert [link.context.span_id for link in cancel.links] == [cancelled.context.span_id]

    rejected = await proxy.client.call_tool("protocol_error_job", {})
    await task_reaches(proxy.client, rejected.result["taskId"], "failed")
    (failed,) = named(spans, "task protocol_error_job")
    assert failed.attributes["mcp.task.status"] == "failed" and failed.status.status_code is StatusCode.ERROR
    assert failed.attributes["rpc.response.status_code"] == "-32602"
    no_secrets(spans)


async def test_trace_context_from_meta_is_continued_and_the_upstream_gets_the_proxys(make_proxy, mcp_upstream, spans):
    proxy = await make_proxy(mcp_upstream, tools=[{"match": "echo_traceparent"}])
    # In _meta (as MCP's semantic conventions carry it), no header: a task whose upstream call carries its span.
    params = {"name": "echo_traceparent", "arguments": {}, "_meta": {**meta(), "traceparent": TRACEPARENT}}
    created = await proxy.client.call("tools/call", params)
    done = await task_reaches(proxy.client, created.result["taskId"], "completed")
    received = done.result["result"]["content"][0]["text"]
    (upstream,) = [s for s in named(spans, "tools/call echo_traceparent") if s.kind is SpanKind.CLIENT]
    assert received == f"00-{CLIENT_TRACE}-{format(upstream.context.span_id, '016x')}-01"

    # Pass-through (no rule for the tool): the upstream's parent is the proxy's request span, not the client's.
    plain = await make_proxy(mcp_upstream, protocol="modern")  # (the era known from the start: the lane relays)
    reply = await plain.client.call_tool("echo_traceparent", {}, tasks=False, headers={"traceparent": TRACEPARENT})
    passed = reply.result["content"][0]["text"]
    request_span = [s for s in named(spans, "tools/call echo_traceparent") if s.kind is SpanKind.SERVER][-1]
    assert passed == f"00-{CLIENT_TRACE}-{format(request_span.context.span_id, '016x')}-01"
    assert format(request_span.parent.span_id, "016x") == CLIENT_SPAN
    assert lane_counts(plain) == {"relayed": 1, "served": 0, "handled": 0, "handed_over": 0}


async def test_without_the_extra_or_an_exporter_tracing_is_off(monkeypatch, make_proxy, mcp_upstream):
    assert tracing.configure({}).startswith("off (no OTEL_TRACES_EXPORTER")
    assert not tracing.TRACER.enabled
    assert "not one of" in tracing.configure({"OTEL_TRACES_EXPORTER": "zipkin"})
    assert tracing.configure({"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"}).startswith("off")
    # A sampler that can record nothing, whatever the client's context: no span is made at all.
    never = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_TRACES_SAMPLER": "always_off"}
    assert tracing.configure(never) == "off (OTEL_TRACES_SAMPLER=always_off: no span is ever recorded)"
    assert not tracing.TRACER.enabled
    assert tracing.configure({**never, "OTEL_TRACES_SAMPLER": "parentbased_always_on"}) == "on (otlp)"
    assert tracing.TRACER.enabled
    tracing.TRACER.shutdown()  # type: ignore[union-attr]
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # as if the otel extra were not installed
    assert "pip install 'mcp-tasks-proxy[otel]'" in tracing.configure({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x"})
    assert not tracing.TRACER.enabled
    proxy = await make_proxy(mcp_upstream)
    reply = await proxy.client.call_tool("echo_traceparent", {}, tasks=False, headers={"traceparent": TRACEPARENT})
    assert reply.result["content"][0]["text"] == TRACEPARENT  # untouched: passed through as the client sent it


@pytest.mark.parametrize("front", ["lane", "aiohttp"])
async def test_with_parentbased_always_off_only_a_sampled_client_context_makes_a_span(make_proxy, mcp_upstream):
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased

    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(ALWAYS_OFF))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(tracing.Tracer(provider, roots_recorded=False))  # as configure() sets it up for this sampler
    try:
        proxy = await make_proxy(mcp_upstream, protocol="modern")
        unsampled = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"
        for sent, expected in (({}, "<none>"), ({"traceparent": unsampled}, unsampled)):
            reply = await proxy.client.call_tool("echo_traceparent", {}, tasks=False, headers=sent)
            assert reply.result["content"][0]["text"] == expected  # passed on as the client sent it, or not at all
        assert exporter.get_finished_spans() == ()  # nothing the sampler could record was made
        # A task's call too: no task span, no attempt span, the client's fields as sent.
        tasked = await make_proxy(mcp_upstream, protocol="modern", tools=[{"match": "echo_traceparent"}])
        for sent, expected in (({}, "<none>"), ({"traceparent": unsampled, "tracestate": "k=v"}, unsampled)):
            created = await tasked.client.call_tool("echo_traceparent", {}, headers=sent)
            done = await task_reaches(tasked.client, created.result["taskId"], "completed")
            assert done.result["result"]["content"][0]["text"] == expected
        assert exporter.get_finished_spans() == ()

        reply = await proxy.client.call_tool("echo_traceparent", {}, tasks=False, headers={"traceparent": TRACEPARENT})
        (request_span,) = named(exporter, "tools/call echo_traceparent")
        assert format(request_span.parent.span_id, "016x") == CLIENT_SPAN
        assert (
            reply.result["content"][0]["text"] == f"00-{CLIENT_TRACE}-{format(request_span.context.span_id, '016x')}-01"
        )
    finally:
        tracing.install(tracing._Off())
        provider.shutdown()
    assert tracing.configure(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_TRACES_SAMPLER": "parentbased_always_off"}
    ).startswith("on (otlp; parentbased_always_off")
    tracing.TRACER.shutdown()  # type: ignore[union-attr]
    tracing.install(tracing._Off())


async def test_a_request_pipelined_behind_a_taken_over_call_gets_none_of_its_trace(make_proxy, legacy_upstream, caplog):
    """A bridged call whose question comes on the session's standalone stream is answered by another task (taken
    over, upstream/bridge.py); the request pipelined behind it starts from there, and must not inherit the first
    request's span: its upstream call carries no trace context, as its client sent none."""
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased

    from tests.test_lane import call, http_post, port_of, raw_exchange

    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(ALWAYS_OFF))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(tracing.Tracer(provider, roots_recorded=False))
    try:
        proxy = await make_proxy(legacy_upstream, protocol="legacy")
        asks = call("ask_roots_standalone", {})
        asks["params"]["_meta"] = meta(tasks=False, roots={})
        sampled = http_post(asks, extra=f"traceparent: {TRACEPARENT}\r\n".encode())
        raw = await raw_exchange(port_of(proxy), sampled + http_post(call("echo_traceparent", {})), read_s=10)
        bodies = [part for part in raw.split(b"\r\n\r\n") if part.startswith(b"{")]
        assert len(bodies) == 2, raw
        assert json.loads(bodies[1])["result"]["content"][0]["text"] == "<none>"
        assert all(format(span.context.trace_id, "032x") == CLIENT_TRACE for span in exporter.get_finished_spans())
        # The first request's span ended in the task that answered it, with nothing to detach there: no error.
        assert [record.getMessage() for record in caplog.records if record.levelname == "ERROR"] == []
    finally:
        tracing.install(tracing._Off())
        provider.shutdown()


async def test_spans_reach_an_otlp_http_receiver(mcp_upstream, tmp_path, aiohttp_server):
    batches: list[ExportTraceServiceRequest] = []

    async def receive(request: web.Request) -> web.Response:
        message = ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        batches.append(message)
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", receive)
    receiver = await aiohttp_server(app)
    port = free_port()
    policy = tmp_path / "policy.yaml"
    policy.write_text("tools:\n  - match: slow_report\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MCP_TASKS_PROXY_", "OTEL_"))}
    env |= {"OTEL_EXPORTER_OTLP_ENDPOINT": str(receiver.make_url("")).rstrip("/"), "OTEL_BSP_SCHEDULE_DELAY": "100",
            "OTEL_SERVICE_NAME": "proxy-under-test"}  # fmt: skip
    argv = [
        sys.executable,
        "-m",
        "mcp_tasks_proxy",
        "--config",
        str(policy),
        "--upstream",
        mcp_upstream,
        "--port",
        str(port),
    ]
    log = tmp_path / "proxy.log"
    with open(log, "wb") as sink:
        process = subprocess.Popen(argv, env=env, cwd=ROOT, stderr=sink)
    try:
        await asyncio.to_thread(wait_for_port, port, process)
        async with aiohttp.ClientSession() as session:
            client = McpClient(session, f"http://127.0.0.1:{port}/mcp")
            created = await client.call_tool("slow_report", {"topic": SECRET, "seconds": 0})
            await task_reaches(client, created.result["taskId"], "completed")

        def names() -> set[str]:
            return {span.name for batch in batches for rs in batch.resource_spans for ss in rs.scope_spans
                    for span in ss.spans}  # fmt: skip

        async def exported() -> bool:
            return {"tools/call slow_report", "task slow_report", "tasks/get"} <= names()

        await eventually(exported, what="the spans reaching the OTLP receiver")
    finally:
        stop(process)
    resource = batches[0].resource_spans[0].resource
    service = {a.key: a.value.string_value for a in resource.attributes}["service.name"]
    assert service == "proxy-under-test"
    assert SECRET.encode() not in b"".join(batch.SerializeToString() for batch in batches)
    assert '"tracing":"on (otlp)"' in log.read_text() or "tracing=on (otlp)" in log.read_text()


async def test_a_malformed_meta_with_tracing_on_is_relayed_not_an_internal_error(make_proxy, mcp_upstream, spans):
    proxy = await make_proxy(mcp_upstream)
    for meta_value in ("x", [1], 3):
        body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"_meta": meta_value}}
        reply = await proxy.client.post_raw(json.dumps(body), {"Content-Type": "application/json",
                                            "Accept": "application/json, text/event-stream"})  # fmt: skip
        assert b"Internal error in the proxy" not in reply.body, reply.body


async def test_each_attempt_is_a_span_that_says_its_number_and_why_it_failed(make_proxy, fake_upstream, spans):
    from tests.test_retries import _failing_then_answering

    fake = await fake_upstream(_failing_then_answering([(503, {})]))
    rule = {"match": "lookup", "idempotent": True, "retry": {"backoff_ms": 10}}
    proxy = await make_proxy(fake.url, protocol="modern", tools=[rule])
    created = await proxy.client.call_tool("lookup", {})
    await task_reaches(proxy.client, created.result["taskId"], "completed")
    attempts = sorted(
        (s for s in named(spans, "tools/call lookup") if s.kind is SpanKind.CLIENT),
        key=lambda span: span.attributes["mcp.task.attempt"],
    )
    assert [span.attributes["mcp.task.attempt"] for span in attempts] == [1, 2]
    assert all(span.attributes["mcp.task.run"] == 1 for span in attempts)
    first, second = attempts
    assert first.status.status_code is StatusCode.ERROR and first.attributes["error.type"] == "unanswered"
    assert second.status.status_code is not StatusCode.ERROR and "error.type" not in second.attributes
    assert first.parent.span_id == second.parent.span_id  # both children of the task's span
