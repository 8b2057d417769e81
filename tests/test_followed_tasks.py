"""A 2025 server's own task as the proxy follows it (upstream/legacy_tasks.py), against a scripted server side:
when it is cancelled and when it is left running for another replica, what a blip of `tasks/get` does, and which
failures of a task followed after a lost replica are the call's own outcome and which are "unknown"."""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

import pytest
from multidict import CIMultiDict

from mcp_tasks_proxy.upstream import legacy_tasks
from mcp_tasks_proxy.upstream.events import Failed, Finished, Progress, UpstreamTask, UpstreamUnavailable
from mcp_tasks_proxy.upstream.legacy_tasks import run_as_upstream_task
from mcp_tasks_proxy.upstream.routing import CallRoute, LegacySession

CALL = {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "slow", "arguments": {}}}
FOLLOWED = UpstreamTask("server-task-1", "session-1", "2025-11-25")


class ScriptedServer:
    """Fault injection: what a 2025 server answers to tasks/get (in turn) and on tasks/result; records every
    method asked."""

    url = "http://upstream.invalid/mcp"
    initialize_result = None

    def __init__(self, polls: list[Any], result: Any = None) -> None:
        self.polls = polls
        self.result = result or Finished({"content": [], "isError": False})
        self.asked: list[str] = []
        self.spawned: list[asyncio.Task] = []

    def spawn(self, coro) -> None:
        self.spawned.append(asyncio.ensure_future(coro))

    async def ask(self, headers, method, params, *, session=None, route=None):
        self.asked.append(method)
        if method != "tasks/get":
            return {"result": {}}
        answer = self.polls.pop(0) if self.polls else {"result": {"taskId": "server-task-1", "status": "working"}}
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def exchange(self, message, headers, capabilities, *, max_bytes, route=None, session=None, verbatim=None):
        self.asked.append(message["method"])
        if message["method"] == "tools/call":  # the task request: the server makes its task
            yield Finished({"task": {"taskId": "server-task-1", "status": "working", "pollInterval": 10}})
        else:
            yield self.result


@pytest.fixture(autouse=True)
def quick_polls(monkeypatch):
    monkeypatch.setattr(legacy_tasks, "_DEFAULT_POLL_S", 0.01)
    monkeypatch.setattr(legacy_tasks, "_backoff_s", lambda failures: 0.0)


def events(server: ScriptedServer, *, follow: UpstreamTask | None = None, detached=None):
    session = LegacySession("session-1", "2025-11-25", "")
    route = CallRoute({}, None)
    return run_as_upstream_task(server, session, CALL, CIMultiDict(), {}, route, 1 << 20, follow, detached)


async def last(stream) -> Any:
    outcome = None
    async for event in stream:
        outcome = event
    return outcome


@pytest.mark.parametrize("detached", [True, False])
async def test_a_call_stopped_while_its_consumer_is_busy_cancels_the_server_task_unless_another_replica_follows_it(
    detached,
):
    server = ScriptedServer(polls=[])
    stream = events(server, detached=lambda: detached)
    made = await anext(stream)
    assert isinstance(made, Progress) and made.upstream_task.task_id == "server-task-1"
    # Stopped while the consumer awaited something else (a store write): the generator sees only its close.
    await stream.aclose()
    await asyncio.gather(*server.spawned)
    assert ("tasks/cancel" in server.asked) is not detached


async def test_a_tasks_get_that_fails_for_a_moment_is_asked_again_and_the_task_goes_on():
    completed = {"result": {"taskId": "server-task-1", "status": "completed"}}
    server = ScriptedServer(polls=[UpstreamUnavailable("connection refused"), {"result": None}, completed])
    outcome = await last(events(server, follow=FOLLOWED))
    assert isinstance(outcome, Finished)
    assert server.asked.count("tasks/get") == 3 and "tools/call" not in server.asked


async def test_a_followed_tasks_own_error_is_the_calls_outcome_not_unknown():
    completed = {"result": {"taskId": "server-task-1", "status": "failed"}}
    own = Failed({"code": -32602, "message": "Unknown tool argument"}, "the upstream answered -32602")
    outcome = await last(events(ScriptedServer(polls=[completed], result=own), follow=FOLLOWED))
    assert outcome == own


async def test_a_followed_task_the_server_no_longer_knows_ends_unknown_and_is_not_cancelled():
    server = ScriptedServer(polls=[{"error": {"code": -32602, "message": "Task not found"}}])
    outcome = await last(events(server, follow=FOLLOWED))
    assert isinstance(outcome, Failed) and outcome.transient is None
    assert outcome.error["data"]["outcome"] == "unknown"
    assert "Task not found" not in str(outcome.error["data"]) and "may or may not" in outcome.error["message"]
    await asyncio.gather(*server.spawned)
    assert "tasks/cancel" not in server.asked


@pytest.mark.parametrize("follow", [FOLLOWED, None])
async def test_a_server_that_stops_answering_tasks_get_ends_the_call_unknown_only_when_it_was_followed(follow):
    server = ScriptedServer(polls=[UpstreamUnavailable("connection refused")] * 10)
    outcome = await last(events(server, follow=follow))
    assert isinstance(outcome, Failed)
    assert server.asked.count("tasks/get") == legacy_tasks._MAX_RESULT_RETRIES + 1  # asked again, then given up
    assert (outcome.error.get("data", {}).get("outcome") == "unknown") is (follow is not None)
    await asyncio.gather(*server.spawned)
    assert "tasks/cancel" in server.asked  # it may still run there: it is cancelled


async def test_a_call_the_server_runs_as_its_task_keeps_nothing_of_its_request_while_it_runs():
    """Once the task request is sent, the call holds none of the request's arguments, however long the server's
    task runs (they may be megabytes)."""

    class Arguments(dict):  # a dict that a weak reference can watch
        pass

    arguments = Arguments(items=list(range(1000)))
    watched = weakref.ref(arguments)
    call = {**CALL, "params": {"name": "slow", "arguments": arguments}}
    session = LegacySession("session-1", "2025-11-25", "")
    stream = run_as_upstream_task(
        ScriptedServer(polls=[]), session, call, CIMultiDict(), {}, CallRoute({}, None), 1 << 20
    )
    del call, arguments
    made = await anext(stream)  # the server made its task; it runs on (tasks/get says "working")
    assert isinstance(made, Progress) and made.upstream_task is not None
    assert watched() is None
    await stream.aclose()
