"""Task creations first (proxy/tasks/precedence.py): a task's upstream call and its settlement wait while creations
are being answered, for those creations only and never long, and every creation counted is uncounted, whatever
its client does."""

from __future__ import annotations

import asyncio
import json

import pytest
from multidict import CIMultiDict

from mcp_tasks_proxy.config import TaskDefaults, ToolRule
from mcp_tasks_proxy.front.context import runner_key
from mcp_tasks_proxy.store.base import MemoryTaskStore
from mcp_tasks_proxy.tasks import precedence as precedence_module
from mcp_tasks_proxy.tasks.job import ToolCall
from mcp_tasks_proxy.tasks.model import TaskStatus
from mcp_tasks_proxy.tasks.precedence import Precedence
from mcp_tasks_proxy.tasks.runner import TaskRunner
from tests.conftest import eventually
from tests.factories import meta, request
from tests.test_lane import http_post, lane_counts, port_of
from tests.test_takeover import GatedUpstream


@pytest.fixture(autouse=True)
def patient(monkeypatch):
    """No release by the clock unless a test asks for it: a stalled loop (a GC pause, a busy host) must not make a
    step go on before the creations it waits for are answered."""
    monkeypatch.setattr(precedence_module, "MAX_WAIT_S", 60.0)


TURNS = 20
"""Loop turns that would run a ready task step many times over: what a waiting step does not take."""


async def turns(count: int = TURNS) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


async def test_a_step_waits_until_as_many_creations_are_answered_as_were_pending_when_it_began():
    precedence = Precedence()
    await asyncio.wait_for(precedence.give_way(), 1)  # nothing pending: at once
    precedence.begin()
    precedence.begin()
    waiting = asyncio.ensure_future(precedence.give_way())
    await turns()
    precedence.begin()  # a creation read after the step began to wait
    precedence.end()
    await turns()
    assert not waiting.done()
    precedence.end()  # as many answered as were pending: the step goes on, the later creation still pending
    await asyncio.wait_for(waiting, 1)
    assert precedence.pending == 1


async def test_a_creation_that_never_ends_holds_a_step_back_for_max_wait_s_at_most(monkeypatch):
    monkeypatch.setattr(precedence_module, "MAX_WAIT_S", 0.05)
    precedence = Precedence()
    precedence.begin()
    first = asyncio.ensure_future(precedence.give_way())
    await turns()
    second = asyncio.ensure_future(precedence.give_way())
    await turns()
    assert not first.done() and not second.done()
    await asyncio.wait_for(asyncio.gather(first, second), 1)
    precedence.end()
    assert precedence.pending == 0


async def test_a_waiting_step_that_is_cancelled_leaves_the_others_waiting_and_then_released():
    precedence = Precedence()
    precedence.begin()
    cancelled = asyncio.ensure_future(precedence.give_way())
    kept = asyncio.ensure_future(precedence.give_way())
    await turns()
    cancelled.cancel()
    await turns()
    assert cancelled.cancelled() and not kept.done()
    precedence.end()
    await asyncio.wait_for(kept, 1)


def test_a_creation_that_waits_for_its_own_call_is_not_counted():
    plain, window = ToolRule(match="t"), ToolRule(match="t", sync_window_ms=100)
    assert Precedence.counts(plain, {"name": "t"})
    assert not Precedence.counts(window, {"name": "t"})  # its answer may be the call's own
    assert not Precedence.counts(plain, {"name": "t", "requestState": "s"})  # an MRTR retry resumes a parked call


def tool_call(tag: str) -> ToolCall:
    message = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "t", "arguments": {"tag": tag}}}
    return ToolCall(tool="t", message=message, headers=CIMultiDict())


@pytest.fixture
async def runner():
    store = MemoryTaskStore(max_tasks=100)
    upstream = GatedUpstream()
    runner = TaskRunner(store, upstream, TaskDefaults)  # type: ignore[arg-type]
    try:
        yield runner, store, upstream
    finally:
        await runner.aclose()


async def test_a_task_sends_its_call_after_the_creation_being_answered(runner):
    runner, _, upstream = runner
    await runner.submit(tool_call("a"), ToolRule(match="t"))  # its call is ready to be sent
    runner.precedence.begin()  # and a creation is read meanwhile
    await turns()
    assert upstream.sent == []
    runner.precedence.end()
    await eventually(lambda: asyncio.sleep(0, upstream.sent == ["a"]), what="the call being sent")


async def test_a_task_writes_its_outcome_after_the_creation_being_answered(runner):
    runner, store, upstream = runner
    record = await runner.submit(tool_call("a"), ToolRule(match="t"))
    await eventually(lambda: asyncio.sleep(0, upstream.sent == ["a"]), what="the call being sent")
    runner.precedence.begin()
    upstream.gates["a"].set()  # the answer is in
    await turns()
    assert (await store.get(record.task_id)).status is TaskStatus.WORKING
    runner.precedence.end()

    async def completed() -> bool:
        return (await store.get(record.task_id)).status is TaskStatus.COMPLETED

    await eventually(completed, what="the outcome being written")


async def test_a_call_in_its_sync_window_does_not_wait_for_creations(runner):
    runner, _, upstream = runner
    runner.precedence.begin()  # never answered, in this test
    window = asyncio.ensure_future(runner.submit(tool_call("a"), ToolRule(match="t", sync_window_ms=10_000)))
    await turns()
    assert upstream.sent == ["a"]
    upstream.gates["a"].set()
    outcome = await asyncio.wait_for(window, 5)
    assert outcome.result == {"content": [], "isError": False}
    runner.precedence.end()


@pytest.fixture
async def proxy(make_proxy, mcp_upstream):
    return await make_proxy(mcp_upstream, protocol="modern", tools=[{"match": "slow_report", "task": "optional"}])


def creation(seconds: float = 0.05) -> dict:
    return request("tools/call", {"name": "slow_report", "arguments": {"seconds": seconds}, "_meta": meta()})


@pytest.mark.parametrize("leaves", ["after_the_answer", "before_the_answer"])
async def test_every_creation_the_lane_counts_is_uncounted_whatever_its_client_does(proxy, leaves):
    precedence = proxy.app[runner_key].precedence
    served = lane_counts(proxy).get("served", 0)
    data = http_post(creation()) * 8  # pipelined: each counted as it is read
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(proxy))
    writer.write(data)
    if leaves == "after_the_answer":
        await reader.readuntil(b"\r\n\r\n")
    writer.close()  # before_the_answer: its answer's task may be cancelled before its first step

    async def uncounted() -> bool:  # once the lane read (and counted) one at least
        return lane_counts(proxy).get("served", 0) > served and precedence.pending == 0

    await eventually(uncounted, what="every creation uncounted")


async def test_a_creation_on_aiohttp_s_path_is_counted_while_it_is_answered(proxy, monkeypatch):
    counts = []
    begin, end = Precedence.begin, Precedence.end
    monkeypatch.setattr(Precedence, "begin", lambda self: (counts.append("begin"), begin(self)))
    monkeypatch.setattr(Precedence, "end", lambda self, _=None: (counts.append("end"), end(self)))
    body = json.dumps(creation()).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(proxy))
    # HTTP/1.0: the lane hands it to aiohttp.
    writer.write(http_post(creation(), body=body).replace(b" HTTP/1.1\r\n", b" HTTP/1.0\r\n", 1))
    assert b"200 OK" in await reader.readuntil(b"\r\n\r\n")
    writer.close()
    assert lane_counts(proxy).get("handed_over") == 1
    assert counts == ["begin", "end"] and proxy.app[runner_key].precedence.pending == 0
