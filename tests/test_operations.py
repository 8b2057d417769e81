"""What operators rely on: metrics, health and readiness, live policy reload, `check`, logs at start-up."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import time

import pytest
import structlog
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from mcp_tasks_proxy.config import load_config
from mcp_tasks_proxy.front.context import policy_key
from mcp_tasks_proxy.policy import PolicyReloader
from tests.conftest import PROXY, ROOT, eventually, free_port, stop, task_reaches, wait_for_port
from tests.factories import headers_for, meta


async def scrape(proxy) -> dict[tuple[str, tuple], float]:
    async with proxy.client.session.get(proxy.url.replace("/mcp", "/metrics")) as response:
        assert response.status == 200
        text = await response.text()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_metrics_follow_tasks_requests_rounds_and_errors(make_proxy, mcp_upstream, upstream_client):
    proxy = await make_proxy(mcp_upstream, tools=[{"match": t} for t in ("slow_report", "gated", "one_question")])
    created = await proxy.client.call_tool("slow_report", {"topic": "m", "seconds": 0})
    await task_reaches(proxy.client, created.result["taskId"], "completed")
    gate = secrets.token_hex(6)
    gated = await proxy.client.call_tool("gated", {"tag": gate})
    asking = await proxy.client.call(
        "tools/call", {"name": "one_question", "arguments": {}, "_meta": meta(elicitation={})}
    )
    await task_reaches(proxy.client, asking.result["taskId"], "input_required")
    await proxy.client.get_task("no-such-task")
    await proxy.client.call("weird/method")

    samples = await scrape(proxy)
    assert value(samples, "mcp_tasks_proxy_tasks_created_total", tool="slow_report") == 1
    assert value(samples, "mcp_tasks_proxy_tasks_finished_total", tool="slow_report", status="completed") == 1
    assert value(samples, "mcp_tasks_proxy_tasks_running", status="working") == 1
    assert value(samples, "mcp_tasks_proxy_tasks_running", status="input_required") == 1
    assert value(samples, "mcp_tasks_proxy_input_rounds_total", tool="one_question") == 1
    assert value(samples, "mcp_tasks_proxy_upstream_call_seconds_count", tool="slow_report", outcome="completed") == 1
    assert value(samples, "mcp_tasks_proxy_requests_total", method="tools/call", mode="task", status="200") == 3
    assert value(samples, "mcp_tasks_proxy_errors_total", code="-32602") == 1
    # A method no MCP revision defines is counted, under "other": clients cannot grow the label set.
    assert value(samples, "mcp_tasks_proxy_requests_total", method="other", mode="passthrough", status="404") == 1
    assert value(samples, "mcp_tasks_proxy_request_seconds_count", method="tasks/get", mode="local") >= 2

    await proxy.client.cancel_task(gated.result["taskId"])
    await upstream_client.call_tool("release", {"tag": gate}, tasks=False)

    async def not_running():
        return value(await scrape(proxy), "mcp_tasks_proxy_tasks_running", status="working") == 0

    await eventually(not_running, what="the running gauge going down")
    samples = await scrape(proxy)
    assert value(samples, "mcp_tasks_proxy_tasks_finished_total", tool="gated", status="cancelled") == 1


async def test_health_readiness_and_metrics_are_never_forwarded(make_proxy, fake_upstream):
    async def handler(request):
        raise AssertionError("must not be reached")

    fake = await fake_upstream(handler)
    proxy = await make_proxy(fake.url, protocol="modern")
    base = proxy.url.removesuffix("/mcp")
    for path, status in (("/healthz", 200), ("/readyz", 200), ("/metrics", 200)):
        async with proxy.client.session.get(base + path) as response:
            assert response.status == status, path
    assert fake.received == []


async def test_readiness_reports_an_unreachable_upstream(make_proxy):
    proxy = await make_proxy(f"http://127.0.0.1:{free_port()}/mcp", protocol="modern")
    async with proxy.client.session.get(proxy.url.replace("/mcp", "/readyz")) as response:
        assert response.status == 503
        body = await response.json()
    assert body["status"] == "not ready" and body["store"] == "ok"
    assert "upstream unreachable" in body["upstream"]


async def not_found(request: web.Request) -> web.Response:
    return web.Response(status=404, text="404: Not Found")


async def web_page(request: web.Request) -> web.Response:
    return web.Response(text="<!doctype html><title>Welcome</title>", content_type="text/html")


async def json_api(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "items": []})


async def get_only(request: web.Request) -> web.Response:
    return web.Response(status=405, headers={"Allow": "GET"}) if request.method == "POST" else web.Response(text="hi")


@pytest.mark.parametrize(
    ("handler", "got"),
    [
        (not_found, "server/discover got HTTP 404, initialize got HTTP 404"),
        (web_page, "server/discover got HTTP 200 text/html, initialize got HTTP 200 text/html"),
        (json_api, "got HTTP 200 application/json that is not JSON-RPC, initialize got HTTP 200 application/json"),
        (get_only, "server/discover got HTTP 405, initialize got HTTP 405"),
    ],
    ids=["404", "web-page", "json-api", "405-on-post"],
)
async def test_an_upstream_that_answers_neither_mcp_era_is_not_ready_and_calls_say_why(
    make_proxy, fake_upstream, handler, got
):
    """A wrong upstream path, or a server that is not MCP, was taken for a 2025 server: /readyz said ready and calls
    failed as "unreachable". Now /readyz says what the era probe found, and calls fail with that."""
    fake = await fake_upstream(handler)
    proxy = await make_proxy(fake.url, tools=[{"match": "slow"}])
    async with proxy.client.session.get(proxy.url.replace("/mcp", "/readyz")) as response:
        body = await response.json()
        assert response.status == 503, body
    assert body["upstream"].startswith("the upstream answered neither MCP era: ") and got in body["upstream"]
    assert body["upstream"].endswith("(is upstream.url's path right?)")
    passed = await proxy.client.call_tool("add", {"a": 1, "b": 2})
    assert "answered neither MCP era" in passed.message["error"]["message"]
    created = await proxy.client.call_tool("slow")
    failed = await task_reaches(proxy.client, created.result["taskId"], "failed")
    assert "answered neither MCP era" in failed.result["statusMessage"]
    assert "unreachable" not in failed.result["statusMessage"] + passed.message["error"]["message"]


class Scripted2025:
    """A 2025 server as some are: server/discover answered with no JSON-RPC at all (a 404, or a plain-text 400
    "missing session"), optionally behind credentials; it answers initialize."""

    def __init__(self, discover_status: int, *, token: str | None = None) -> None:
        self.discover_status = discover_status
        self.token = token
        self.deleted: list[str | None] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if self.token is not None and request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.Response(status=401, headers={"WWW-Authenticate": 'Bearer resource_metadata="x"'})
        if request.method == "DELETE":
            self.deleted.append(request.headers.get("Mcp-Session-Id"))
            return web.Response(status=200)
        message = await request.json()
        if message.get("method") == "initialize":
            result = {"protocolVersion": "2025-06-18", "capabilities": {"tools": {}}, "serverInfo": {"name": "s"}}
            return web.json_response(
                {"jsonrpc": "2.0", "id": message["id"], "result": result}, headers={"Mcp-Session-Id": "s1"}
            )
        if "Mcp-Session-Id" not in request.headers:
            return web.Response(status=self.discover_status, text="missing session")
        if "id" not in message:
            return web.Response(status=202)
        answer = {"content": [{"type": "text", "text": "3"}], "isError": False}
        return web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": answer})


@pytest.mark.parametrize("discover_status", [404, 400])
async def test_a_2025_server_that_answers_only_initialize_is_still_detected(make_proxy, fake_upstream, discover_status):
    server = Scripted2025(discover_status)
    fake = await fake_upstream(server.handle)
    proxy = await make_proxy(fake.url)
    async with proxy.client.session.get(proxy.url.replace("/mcp", "/readyz")) as response:
        assert response.status == 200, await response.text()
    assert server.deleted == ["s1"]  # the probe's own session, ended
    reply = await proxy.client.call_tool("add", {"a": 1, "b": 2}, tasks=False)
    assert reply.result["content"][0]["text"] == "3"


async def test_a_2025_server_behind_credentials_is_ready_and_learnt_with_a_clients_credentials(
    make_proxy, fake_upstream
):
    server = Scripted2025(404, token="secret")
    fake = await fake_upstream(server.handle)
    proxy = await make_proxy(fake.url)
    async with proxy.client.session.get(proxy.url.replace("/mcp", "/readyz")) as response:
        assert response.status == 200, await response.text()  # an MCP server: it wants credentials (401)
    reply = await proxy.client.call_tool(
        "add", {"a": 1, "b": 2}, tasks=False, headers={"Authorization": "Bearer secret"}
    )
    assert reply.result["content"][0]["text"] == "3"


async def test_upstream_errors_and_legacy_sessions_are_exported(make_proxy, legacy_upstream):
    gone = await make_proxy(
        f"http://127.0.0.1:{free_port()}/mcp", protocol="modern", tools=[{"match": "slow_*", "retry": {"attempts": 1}}]
    )  # one attempt: each attempt counts
    assert (await gone.client.call_tool("add", {"a": 1, "b": 2})).status == 502  # pass-through: answered 502
    created = await gone.client.call_tool("slow_report", {"topic": "t", "seconds": 0})
    await task_reaches(gone.client, created.result["taskId"], "failed")  # a task's attempt
    samples = await scrape(gone)
    assert value(samples, "mcp_tasks_proxy_upstream_errors_total", where="request") == 1
    assert value(samples, "mcp_tasks_proxy_upstream_errors_total", where="task") == 1
    assert ("mcp_tasks_proxy_store_errors_total", ()) not in samples  # the memory store never fails

    legacy = await make_proxy(legacy_upstream, protocol="legacy")
    before = await scrape(legacy)
    assert value(before, "mcp_tasks_proxy_legacy_sessions", side="upstream") == 0
    reply = await legacy.client.call_tool("add", {"a": 1, "b": 2}, tasks=False)
    assert reply.status == 200, reply.message
    after = await scrape(legacy)
    assert value(after, "mcp_tasks_proxy_legacy_sessions", side="upstream") == 1
    assert value(after, "mcp_tasks_proxy_legacy_sessions", side="client") == 0


async def test_reload_applies_new_rules_to_new_calls_only_and_refuses_invalid_files(
    make_proxy, mcp_upstream, upstream_client, tmp_path
):
    path = tmp_path / "policy.yaml"
    path.write_text(f"upstream:\n  url: {mcp_upstream}\ntools:\n  - match: gated\n    timeout_s: 600\n")
    proxy = await make_proxy(mcp_upstream, tools=[{"match": "gated", "timeout_s": 600}])
    policy = proxy.app[policy_key]
    reloader = PolicyReloader(policy, str(path), lambda: load_config(path))
    gate = secrets.token_hex(6)
    running = await proxy.client.call_tool("gated", {"tag": gate})

    rules = "tools:\n  - match: gated\n    timeout_s: 0.2\n  - match: add\n    task: required\n"
    path.write_text(f"upstream:\n  url: {mcp_upstream}\n{rules}")
    assert reloader.reload("test")
    # New calls get the new rules at once ...
    refused = await proxy.client.call_tool("add", {"a": 1, "b": 2}, tasks=False)
    assert refused.error["code"] == -32021
    quick = await proxy.client.call_tool("gated", {"tag": secrets.token_hex(6)})
    assert (
        (await task_reaches(proxy.client, quick.result["taskId"], "failed"))
        .result["statusMessage"]
        .endswith("0.2 s limit (timeout_s)")
    )
    # ... while the running task keeps the rule it started with (600 s): it is still working, then completes.
    assert (await proxy.client.get_task(running.result["taskId"])).result["status"] == "working"
    await upstream_client.call_tool("release", {"tag": gate}, tasks=False)
    await task_reaches(proxy.client, running.result["taskId"], "completed")

    path.write_text("tools:\n  - match: add\n    task: sometimes\n")
    with structlog.testing.capture_logs() as logs:
        assert not reloader.reload("test")
    assert logs[0]["event"] == "policy_reload_refused"
    assert "tools.0.task" in logs[0]["error"]
    assert policy.config.rule_for("add").task.value == "required"  # the running policy stays


def test_sighup_and_file_changes_reload_the_running_command(mcp_upstream, tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text("tools: []\n")
    port = free_port()
    log_path = tmp_path / "proxy.log"
    with open(log_path, "wb") as sink:
        process = subprocess.Popen(
            [*PROXY, "--config", str(path), "--upstream", mcp_upstream,
             "--port", str(port), "--log-format", "json"],
            stderr=sink, cwd=ROOT,
        )  # fmt: skip
    try:
        wait_for_port(port, process)
        path.write_text("tools:\n  - match: add\n    task: required\n")  # picked up by the file watch
        deadline = time.monotonic() + 30
        while b'"policy_reloaded"' not in log_path.read_bytes():
            assert time.monotonic() < deadline, "the file change was not picked up"
            time.sleep(0.1)
        path.write_text("tools: [\n")  # invalid, and announced with SIGHUP
        process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while b'"policy_reload_refused"' not in log_path.read_bytes():
            assert time.monotonic() < deadline, "SIGHUP did not reload"
            time.sleep(0.1)
        assert process.poll() is None  # still serving, with the last good policy
    finally:
        stop(process)
    text = log_path.read_text()
    assert '"reason":"file changed"' in text and '"reason":"SIGHUP"' in text


def test_check_prints_the_rule_each_tool_gets(mcp_upstream, tmp_path):
    done = subprocess.run(
        [*PROXY, "check", "config/sidecar.yaml", "export_all", "search", "delete_me", "other"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "config/sidecar.yaml: valid, 3 rule(s)"
    assert lines[2].split() == ["export_all", "export_*", "required", "0", "7200"]
    assert lines[3].split() == ["search", "search", "optional", "2000", "300"]
    assert lines[5].split() == ["other", "(none)", "passthrough"]
    asked = subprocess.run(
        [*PROXY, "check", "config/example.yaml", "--upstream", mcp_upstream],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert asked.returncode == 0, asked.stderr
    assert "lists" in asked.stdout
    assert any(line.split()[:3] == ["slow_report", "slow_*", "optional"] for line in asked.stdout.splitlines())
    bad = tmp_path / "bad.yaml"
    bad.write_text("tools:\n  - match: a\n    taks: x\n")
    refused = subprocess.run([*PROXY, "check", str(bad)], capture_output=True, text=True)
    assert refused.returncode == 2
    assert "tools.0.taks: unknown key" in refused.stderr


async def test_passthrough_requests_are_counted_by_method(make_proxy, mcp_upstream):
    proxy = await make_proxy(mcp_upstream)
    assert (await proxy.client.call("tools/list")).status == 200
    samples = await scrape(proxy)
    assert value(samples, "mcp_tasks_proxy_requests_total", method="tools/list", mode="passthrough", status="200") == 1


async def test_a_stream_the_client_closes_is_counted_and_logged_as_client_closed(make_proxy, fake_upstream):
    """Inspector closes its streams on every run: that is the client leaving (499), not a proxy failure (500)."""
    release = asyncio.Event()

    async def endless_stream(request: web.Request) -> web.StreamResponse:
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        await stream.write(b'event: message\ndata: {"jsonrpc":"2.0","method":"notifications/message","params":{}}\n\n')
        await release.wait()
        return stream

    upstream = await fake_upstream(endless_stream)
    proxy = await make_proxy(upstream.url, protocol="modern", logging={"level": "info"})
    message = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"_meta": meta(tasks=False)}}
    with structlog.testing.capture_logs() as logs:
        for method, body in (("POST", message), ("GET", None)):
            headers = {**headers_for(message), "Accept": "application/json, text/event-stream"}
            async with proxy.client.session.request(method, proxy.url, json=body, headers=headers) as response:
                assert response.status == 200
                await response.content.readline()  # the first event arrived: the client leaves mid-stream

        async def both_counted():
            samples = await scrape(proxy)
            counted = [value(samples, "mcp_tasks_proxy_requests_total", method=m, mode="passthrough", status="499")
                       for m in ("tools/list", "none")]  # fmt: skip
            return counted == [1, 1]

        await eventually(both_counted, what="two requests counted with status 499")
    release.set()
    samples = await scrape(proxy)
    assert not [key for key in samples if key[0] == "mcp_tasks_proxy_requests_total" and ("status", "500") in key[1]]
    handled = [line for line in logs if line["event"] == "request_handled"]
    assert [(line["status"], line["client_closed"]) for line in handled] == [(499, True), (499, True)]
    assert not [line for line in logs if line["log_level"] in ("error", "critical") or "exception" in line]


async def test_tool_names_from_clients_cannot_grow_the_metrics(make_proxy, mcp_upstream, monkeypatch):
    # A glob rule matches any name a client sends: past the bound, names count together as "_other".
    monkeypatch.setattr("mcp_tasks_proxy.metrics.MAX_LABEL_VALUES", 3)
    proxy = await make_proxy(mcp_upstream, tools=[{"match": "*", "task": "required"}])
    names = [f"no_such_tool_{n}" for n in range(6)]
    for name in names:
        created = await proxy.client.call_tool(name, {})
        await task_reaches(proxy.client, created.result["taskId"], "completed", "failed")
    samples = await scrape(proxy)
    created_by_tool = {
        dict(labels)["tool"]: count
        for (metric, labels), count in samples.items()
        if metric == "mcp_tasks_proxy_tasks_created_total"
    }
    assert created_by_tool == {**dict.fromkeys(names[:3], 1.0), "_other": 3.0}
    finished = [dict(labels)["tool"] for metric, labels in samples if metric == "mcp_tasks_proxy_tasks_finished_total"]
    assert sorted(finished) == sorted([*names[:3], "_other"])


async def test_a_tool_name_longer_than_a_label_may_be_counts_as_other_and_is_logged_cut(make_proxy, mcp_upstream):
    # Every scrape repeats a label on each line of its series, and every request writes a log line: a client's tool
    # name of megabytes must not be either (one of 4 MB made each scrape 150 MB).
    from mcp_tasks_proxy.log import MAX_LOGGED_CHARS, _bounded_values
    from mcp_tasks_proxy.metrics import MAX_LABEL_CHARS

    proxy = await make_proxy(mcp_upstream, tools=[{"match": "*", "task": "required"}])
    long_name = "t" * (MAX_LABEL_CHARS + 1)
    created = await proxy.client.call_tool(long_name, {})
    await task_reaches(proxy.client, created.result["taskId"], "completed", "failed")
    samples = await scrape(proxy)
    tools = {dict(labels).get("tool") for (metric, labels) in samples if metric.startswith("mcp_tasks_proxy_tasks_")}
    assert "_other" in tools and long_name not in tools
    line = _bounded_values(None, "info", {"event": "request_handled", "tool": "t" * 4_000_000})
    assert line["tool"] == "t" * MAX_LOGGED_CHARS + "... (4000000 characters)"


def test_json_log_lines_are_compact_json_whatever_their_fields_hold():
    """Every request writes a line: orjson renders it, and what orjson refuses (an integer past 64 bits, a lone
    surrogate, a key that is not a string) still makes a line of valid JSON, never an error in the request. No
    line breaks in two for a reader that splits at U+2028 (a tool's name is the client's), a dataclass shows its
    repr (no repr=False field), and aiohttp's own lines are valid JSON whatever stderr's encoding."""
    import json
    import sys

    script = r"""
import dataclasses, logging, structlog
from mcp_tasks_proxy.log import configure_logging
configure_logging(level="info", format="json")
log = structlog.get_logger("t")

@dataclasses.dataclass
class Target:
    host: str
    password: str = dataclasses.field(repr=False, default="hunter2")

log.info("plain", tool="ec\u2028ho\u2029\u0085 caf\u00e9", n=1)
log.info("odd", n=2**70, s="\udcff", k={1: 2}, o=object.__new__(type("Thing", (), {"__repr__": lambda self: "thing"})))
log.info("target", store=Target("redis"))
logging.getLogger("aiohttp.server").warning("from %s", "caf\u00e9")
try:
    1 / 0
except ZeroDivisionError:
    log.exception("failed")
log.debug("not written")
"""
    for encoding in ("utf-8", "ascii"):
        env = {**os.environ, "PYTHONIOENCODING": encoding}
        done = subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, timeout=60, env=env)
        assert done.returncode == 0, done.stderr
        lines = done.stderr.decode().splitlines()  # splits at U+2028, U+2029 and U+0085 too
        assert len(lines) == 5, lines
        assert all(line.startswith('{"') and '":' in line and '": ' not in line for line in lines)  # compact
        plain, odd, target, stdlib, failed = (json.loads(line) for line in lines)
        assert plain["event"] == "plain" and plain["tool"] == "ec\u2028ho\u2029\u0085 caf\u00e9"
        assert plain["level"] == "info" and plain["timestamp"].endswith("Z") and plain["timestamp"][:4].isdigit()
        assert odd["n"] == 2**70 and odd["s"] == "\udcff" and odd["k"] == {"1": 2} and odd["o"] == "thing"
        assert odd["timestamp"].endswith("Z")
        assert target["store"] == "Target(host='redis')"
        assert "hunter2" not in done.stderr.decode()
        assert stdlib["event"] == "from caf\u00e9" and stdlib["level"] == "warning"
        assert failed["exception"][0]["exc_type"] == "ZeroDivisionError"


def test_the_request_counter_and_histogram_expose_what_prometheus_client_s_own_would():
    """_RequestStats keeps plain numbers in place of prometheus_client's labelled children (metrics.py says why):
    the same observations, through both, must read the same at a scrape, bucket bounds included."""
    import random

    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    from mcp_tasks_proxy.metrics import _LATENCY_BUCKETS, Metrics

    ours = Metrics()
    registry = CollectorRegistry()
    requests = Counter("mcp_tasks_proxy_requests", "", ["method", "mode", "status"], registry=registry)
    latency = Histogram(
        "mcp_tasks_proxy_request_seconds", "", ["method", "mode"], buckets=_LATENCY_BUCKETS, registry=registry
    )
    rng = random.Random(48)
    # On every bound and either side of it, zero, and past the last bound, with random ones between.
    edges = [b * f for b in _LATENCY_BUCKETS for f in (1, 1 - 1e-12, 1 + 1e-12)] + [0.0, 61.0, 3600.0]
    for n in range(2_000):
        seconds = edges[n] if n < len(edges) else rng.expovariate(1 / 0.2)
        method, mode = rng.choice(["tools/call", "tasks/get", "other"]), rng.choice(["passthrough", "task", "local"])
        status = rng.choice([200, 202, 400, 502])
        ours.observe_request(method, mode, status, seconds)
        requests.labels(method, mode, str(status)).inc()
        latency.labels(method, mode).observe(seconds)

    def samples(text: bytes, prefix: str) -> dict[tuple, float]:
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text.decode())
            if family.name.startswith(prefix)
            for sample in family.samples
            if not sample.name.endswith("_created")  # prometheus_client's creation times: not a count
        }

    for prefix in ("mcp_tasks_proxy_requests", "mcp_tasks_proxy_request_seconds"):
        expected = samples(generate_latest(registry), prefix)
        got = samples(ours.render(), prefix)
        assert len(expected) >= 36  # every (method, mode, status), every (method, mode) with its buckets
        assert got.keys() == expected.keys(), prefix
        for key, value in expected.items():
            assert got[key] == pytest.approx(value, rel=1e-9), key


async def test_operations_are_measured_in_the_semantic_conventions_names(make_proxy, mcp_upstream):
    """mcp.server.operation.duration and mcp.client.operation.duration (the OpenTelemetry MCP semantic conventions),
    as Prometheus names them: a success, a refusal past a rate limit (429), a JSON-RPC error the proxy answered, and
    a task's call upstream."""
    from tests.test_dashboards import scrape

    limits = {"rates": [{"per": "tool", "match": "add", "requests_per_s": 0.001, "burst": 1}]}
    proxy = await make_proxy(mcp_upstream, protocol="modern", tools=[{"match": "slow_report"}], limits=limits)
    assert (await proxy.client.call_tool("add", {"a": 1, "b": 2}, tasks=False)).status == 200
    assert (await proxy.client.call_tool("add", {"a": 1, "b": 2}, tasks=False)).status == 429
    assert (await proxy.client.get_task("no-such-task")).error["code"] == -32602
    created = await proxy.client.call_tool("slow_report", {"topic": "semconv", "seconds": 0})
    await task_reaches(proxy.client, created.result["taskId"], "completed")
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(await scrape(proxy))
        for sample in family.samples
    }

    def count(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return samples.get(key, 0.0)

    server = "mcp_server_operation_duration_seconds_count"
    common = {"mcp_protocol_version": "2026-07-28", "network_transport": "tcp"}
    assert count(server, mcp_method_name="tools/call", gen_ai_tool_name="add", error_type="", **common) == 1
    assert count(server, mcp_method_name="tools/call", gen_ai_tool_name="add", error_type="429", **common) == 1
    assert count(server, mcp_method_name="tasks/get", gen_ai_tool_name="", error_type="-32602", **common) == 1
    client = "mcp_client_operation_duration_seconds_count"
    assert count(client, gen_ai_tool_name="slow_report", error_type="") == 1
