"""Task creations first (proxy/tasks/precedence.py): a task's upstream call and its settlement wait while creations
are being answered, for those creations only and never long, and every creation counted is uncounted, whatever
its client does."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from multidict import CIMultiDict

from mcp_tasks_proxy.config import TaskDefaults, ToolRule
from mcp_tasks_proxy.context import runner_key
from mcp_tasks_proxy.tasks import precedence as precedence_module
from mcp_tasks_proxy.tasks.job import ToolCall
from mcp_tasks_proxy.tasks.model import TaskStatus
from mcp_tasks_proxy.tasks.precedence import Precedence
from mcp_tasks_proxy.tasks.runner import TaskRunner
from mcp_tasks_proxy.tasks.store import MemoryTaskStore
from mcp_tasks_proxy.upstream.events import Finished
from tests.conftest import eventually
from tests.factories import meta, request
from tests.test_lane import http_post, lane_counts, port_of

TURNS = 20
"""Loop turns that would run a ready task step many times over: what a waiting step does not take."""


async def turns(count: int = TURNS) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


async def test_a_step_gives_way_to_the_creations_pending_when_it_waits_and_not_to_later_ones():
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
    precedence.end()  # nothing left waiting: the release timer is gone, the count back to zero
    assert precedence.pending == 0 and precedence._release is None


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


@pytest.mark.parametrize("fails", [False, True])
async def test_a_creation_with_a_sync_window_is_not_counted_and_a_counted_one_is_uncounted_however_it_ends(fails):
    precedence = Precedence()
    with precedence.creating(ToolRule(match="t", sync_window_ms=100)):
        assert precedence.pending == 0  # it waits for its own call: the call must not wait for it
    raised = pytest.raises(RuntimeError) if fails else contextlib.nullcontext()
    with raised, precedence.creating(ToolRule(match="t")):
        assert precedence.pending == 1
        if fails:
            raise RuntimeError("the creation failed")
    assert precedence.pending == 0


class GatedUpstream:
    """Fault injection: each call waits at its own gate; records what was sent."""

    url = "http://upstream.invalid/mcp"
    known_era = "modern"
    tasks_reach_replicas = False

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.gates: dict[str, asyncio.Event] = {}

    def call_tool(self, message, headers, capabilities, *, max_bytes, on_request, session, follow, detached=None):
        tag = message["params"]["arguments"]["tag"]
        self.sent.append(tag)
        gate = self.gates.setdefault(tag, asyncio.Event())

        async def events():
            await gate.wait()
            yield Finished(result={"content": [], "isError": False})

        return events()

    async def notify_cancelled(self, request_id, headers, reason) -> None:
        pass


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


@pytest.mark.parametrize("leaves", ["after_the_answer", "before_the_answer", "mid_request"])
async def test_every_creation_the_lane_counts_is_uncounted_whatever_its_client_does(proxy, leaves):
    precedence = proxy.app[runner_key].precedence
    served = lane_counts(proxy).get("served", 0)
    data = http_post(creation()) * 8  # pipelined: each counted as it is read
    if leaves == "mid_request":
        data += http_post(creation())[:-5]
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(proxy))
    writer.write(data)
    if leaves == "after_the_answer":
        await reader.readuntil(b"\r\n\r\n")
    writer.close()  # before_the_answer: its answer's task may be cancelled before its first step

    async def uncounted() -> bool:  # once the lane read (and counted) one at least
        return lane_counts(proxy).get("served", 0) > served and precedence.pending == 0

    await eventually(uncounted, what="every creation uncounted")
    assert not precedence._waiting and precedence._release is None
