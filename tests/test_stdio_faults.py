"""A stdio child that writes what cannot be read, or leaves a process behind that holds its pipes.

An answer the proxy cannot read (a byte that is not UTF-8, a line cut short, a response with neither result nor
error) fails the call it answered at once, pass-through or task, and is counted by reason on /metrics; one that
names no call is logged and counted and disturbs nothing. A child that leaves a grandchild in a session of its own
holding its pipes is restarted with its old pipes closed: the proxy's open descriptors do not grow with restarts.
tests/stdio_hostile.py injects the faults.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path

import pytest
import structlog
import uvloop
from prometheus_client.parser import text_string_to_metric_families

from mcp_tasks_proxy.upstream.stdio import process as stdio_process
from mcp_tasks_proxy.upstream.stdio.process import ChildSpec, Supervisor, unreadable
from tests.conftest import ROOT, eventually, python_steps, task_reaches
from tests.test_stdio import hostile_command, stdio_proxy, tool_text

BROKEN = {
    "invalid_utf8": ("invalid_utf8", "it is not valid UTF-8 (byte 0xff at offset"),
    "truncated": ("not_json", "it is not JSON ("),
    "no_result": ("not_jsonrpc", "it has neither a result nor an error"),
    "bad_method": ("not_jsonrpc", "its method is not a string"),
    "batch": ("not_jsonrpc", "it is a batch"),
}
"""How tests/stdio_hostile.py breaks echo's answer (mode `unreadable`) → the reason counted, what the error says."""


async def unreadable_counts(proxy) -> dict[str, float]:
    async with proxy.client.session.get(proxy.url.replace("/mcp", "/metrics")) as response:
        text = await response.text()
    (family,) = (f for f in text_string_to_metric_families(text) if f.name == "mcp_tasks_proxy_upstream_unreadable")
    return {s.labels["reason"]: s.value for s in family.samples if s.name.endswith("_total")}


async def test_an_unreadable_answer_fails_its_call_at_once_and_is_counted(make_proxy):
    proxy = await stdio_proxy(make_proxy, hostile_command("unreadable"), tools=[])
    for how, (reason, why) in BROKEN.items():
        reply = await asyncio.wait_for(proxy.client.call_tool("echo", {"text": how}, tasks=False), 30)
        error = reply.message.get("error")
        assert error is not None and error["code"] == -32603, (how, reply.message)
        assert error["message"].startswith("Upstream failure: the stdio server's answer could not be read: "), error
        assert why in error["message"], (how, error)
        assert error["data"] == {"upstream": f"stdio:{Path(sys.executable).name}", "reason": reason}, (how, error)
    assert await tool_text(proxy, "echo", {"text": "after"}) == "after"  # the child and its channel go on
    counts = await unreadable_counts(proxy)
    assert counts == {"too_long": 0, "invalid_utf8": 1, "not_json": 1, "non_finite_number": 0, "not_jsonrpc": 3}


async def test_a_task_whose_answer_has_an_invalid_byte_fails_with_the_reason(make_proxy):
    proxy = await stdio_proxy(make_proxy, hostile_command("unreadable"), tools=[{"match": "echo"}])
    created = await proxy.client.call_tool("echo", {"text": "invalid_utf8"})
    failed = await task_reaches(proxy.client, created.result["taskId"], "failed", "completed")
    error = failed.result["error"]
    assert error["code"] == -32603, failed.result
    assert "the stdio server's answer could not be read: it is not valid UTF-8" in error["message"], error
    assert error["data"]["reason"] == "invalid_utf8", error


async def test_an_answer_with_nan_fails_its_call(make_proxy):
    proxy = await stdio_proxy(make_proxy, hostile_command("unreadable"), tools=[])
    reply = await asyncio.wait_for(proxy.client.call_tool("echo", {"text": "nan"}, tasks=False), 30)
    assert "it has a number that is not finite (NaN)" in reply.message["error"]["message"], reply.message


async def test_an_unreadable_line_that_names_no_call_is_logged_counted_and_disturbs_nothing(make_proxy):
    proxy = await stdio_proxy(make_proxy, hostile_command("unreadable"), tools=[])
    with structlog.testing.capture_logs() as logs:
        # The child writes a line with a byte 0xff for call "m999.1" (none), a banner, then the answer itself.
        assert await tool_text(proxy, "echo", {"text": "stray"}) == "stray"
    lines = [
        (log["reason"], log["failed_calls"], log["line"]) for log in logs if log["event"] == "upstream_line_unreadable"
    ]
    assert lines == [("invalid_utf8", [], None), ("not_json", [], "not a message")], logs  # no result in a log
    counts = await unreadable_counts(proxy)
    assert counts["invalid_utf8"] == 1 and counts["not_json"] == 1, counts


def test_a_lenient_reading_tells_whose_answer_a_line_was():
    refused = ValueError("refused")
    cases = {
        b'{"jsonrpc":"2.0","id":"m1.2","result":{"t":"\xff"}}': ("invalid_utf8", ("m1.2",)),
        b'{"result":{"v":NaN},"jsonrpc":"2.0","id":"m1.3"}': ("non_finite_number", ("m1.3",)),
        b'{"jsonrpc":"2.0","id":"m1.4","result":{"v":-1e999}}': ("non_finite_number", ("m1.4",)),
        b'{"jsonrpc":"2.0","id":"m1.8","result":{"v":1' + b"0" * 400 + b"}}": ("non_finite_number", ("m1.8",)),
        b'[{"jsonrpc":"2.0","id":"m1.5","result":{}},{"jsonrpc":"2.0","id":"c1","method":"ping","v":NaN}]': (
            "non_finite_number",
            ("m1.5",),  # a request of the child's in it names no call of the proxy's
        ),
        b'{"jsonrpc":"2.0","id":"m1.6","result":{': ("not_json", None),  # only its edges can tell
        b"Server starting...": ("not_json", None),
    }
    for line, (reason, ids) in cases.items():
        found = unreadable(line, refused)
        assert (found.reason, found.ids) == (reason, ids), line
        assert found.size == len(line) and found.head == line[:256] and found.tail == line[-256:]
    detail = unreadable(b'{"id":"m1.7","result":{"v":1e999}}', refused).detail
    assert detail == "it has a number that is not finite (1e999)"


def test_a_message_that_is_neither_request_nor_response_is_counted_even_when_it_names_no_call():
    from types import SimpleNamespace

    from mcp_tasks_proxy.upstream.stdio.channel import StdioChannel

    channel = StdioChannel(ChildSpec(argv=["server"], env={}), max_in_flight=10)
    child = SimpleNamespace(generation=1, pid=None)
    for bad in ({"id": "m9.9"}, {"id": ["m9.9"], "result": {}, "error": {}}, {"id": "m9.9", "method": 5}):
        channel._received(child, {"jsonrpc": "2.0", **bad}, 10)
    channel._received(child, {"jsonrpc": "2.0", "id": "m9.9", "result": {}}, 10)  # a late answer: only dropped
    assert channel.unreadable == {"not_jsonrpc": 3} and channel._refused == 1


# --- a grandchild that holds the pipes ----------------------------------------------------------------------------


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def _restarts(pid_file: Path, runs: int) -> tuple[list[int], list[int]]:
    """Run a child that leaves a grandchild holding its pipes and exits, until it has started `runs` times: the
    number of the process's open descriptors as each run started, and the exit statuses seen."""
    fds: list[int] = []
    statuses: list[int] = []
    spec = ChildSpec(
        argv=[sys.executable, str(ROOT / "tests" / "stdio_hostile.py"), "leaves_a_grandchild", str(pid_file)],
        env=dict(os.environ),
        restart_min_s=0.01,
        restart_max_s=0.01,
    )
    supervisor = Supervisor(
        spec,
        on_start=lambda child: fds.append(open_fds()),
        on_exit=lambda child, status: statuses.append(status),
        on_message=lambda child, message, size: None,
        on_unreadable=lambda child, line: None,
    )
    await supervisor.start()

    async def started_enough() -> bool:
        return len(fds) >= runs

    try:
        await eventually(started_enough, what=f"{runs} runs of the child")
    finally:
        await supervisor.stop()
    return fds, statuses


@pytest.mark.parametrize("loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
def test_restarts_close_the_pipes_a_detached_grandchild_holds(loop_factory, tmp_path, monkeypatch):
    monkeypatch.setattr(stdio_process, "_LAST_OUTPUT_S", 0.2)  # the grandchild never closes them: no end of file
    pid_file = tmp_path / "grandchildren"
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            fds, statuses = runner.run(_restarts(pid_file, runs=6))
    finally:
        for pid in pid_file.read_text().split() if pid_file.exists() else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    assert len(pid_file.read_text().split()) >= 5  # each run left one behind, holding its pipes
    assert set(statuses) == {1}, statuses  # every exit was seen (its calls failed), though the pipes stayed open
    assert fds[1:] == [fds[0]] * (len(fds) - 1), fds  # a run's pipes are closed before the next one starts


# --- a child's own lines, many calls in flight ------------------------------------------------------------------


def test_a_childs_request_finds_its_call_without_a_step_per_call_in_flight():
    # Counted, not timed: each request of the child's (or log line naming a task) was tied to its call by a scan of
    # every exchange in flight, 6 ms a line at 10,000. Python steps are counted while 200 requests are tied.
    from types import SimpleNamespace

    from mcp_tasks_proxy.upstream.routing import CallRoute
    from mcp_tasks_proxy.upstream.stdio.channel import StdioChannel
    from mcp_tasks_proxy.upstream.stdio.exchange import Exchange

    channel = StdioChannel(ChildSpec(argv=["server"], env={}), max_in_flight=20_000)
    child = SimpleNamespace(generation=1, pid=None)
    exchanges = []
    for number in range(10_000):
        route = CallRoute({}, None, upstream_task=True)
        if number % 2:
            route.upstream_task_id = f"task-{number}"  # named before its exchange, or (below) while it runs
        exchange = Exchange(channel, f"m1.{number}", {"id": number, "method": "tools/call"}, route)
        channel._pending.add(exchange)
        exchanges.append(exchange)
        channel._pending.add(Exchange(channel, f"m1.q{number}", {"id": -number, "method": "tools/list"}, None))
    for number in range(0, 10_000, 2):
        exchanges[number].route.name_task(f"task-{number}")  # as legacy_tasks.py names it, once the server made it

    def ask(task_id: str | None, number: int) -> str | None:
        meta = {} if task_id is None else {"_meta": {"io.modelcontextprotocol/related-task": {"taskId": task_id}}}
        message = {"jsonrpc": "2.0", "id": number, "method": "elicitation/create", "params": {"message": "?", **meta}}
        return channel._initiated.request(child, message, 100)

    with python_steps() as steps:
        outcomes = [ask(f"task-{number}", number) for number in range(0, 10_000, 100)]
        outcomes += [ask("task-none", number) for number in range(50)]
        outcomes += [ask(None, number) for number in range(50)]
    calls = steps[0]
    assert outcomes[:100] == [None] * 100
    assert all(exchanges[number].asked for number in range(0, 10_000, 100))
    assert not any(exchanges[number].asked for number in range(1, 10_000, 100))
    assert outcomes[100:150] == ["it names task 'task-none', which no call in flight follows"] * 50
    assert outcomes[150:] == ["10000 calls are in flight on the stdio server and the request names none of them"] * 50
    assert calls < 200 * 80, calls  # a few dozen lines a request, not some per call in flight

    for exchange in exchanges[1:]:
        channel._pending.pop(exchange.child_id)
    assert channel.asking == 1 and ask(None, 1) is None  # the one call left may ask: any request is its own
    assert len(exchanges[0].asked) == 2
