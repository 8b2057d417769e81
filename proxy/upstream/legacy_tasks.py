"""Upstreams with tasks of their own: a 2025-11-25 server's experimental tasks (SEP-1686), driven by the proxy.

A tool the server marks `execution.taskSupport: required` cannot be called plainly, and one marked `optional` is
better run as the server's own task (nothing long waits on one open stream). When the proxy runs such a tool for a
client, it makes the upstream task (`params.task`), follows it with `tasks/get`, reads its input requests and its
final answer on `tasks/result` (the side channel SEP-1686 gives them), and cancels it with `tasks/cancel`. The
client sees the same events as from any other call: progress, input rounds, then the exact result or error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import structlog
from multidict import MultiMapping

from ..clients.envelope import without_meta_key
from ..jsonrpc import INTERNAL_ERROR, error_object
from .events import (
    Event,
    Failed,
    Finished,
    Progress,
    UpstreamTask,
    UpstreamUnavailable,
    proxy_failure,
)
from .routing import RELATED_TASK, CallRoute, LegacySession

log = structlog.get_logger(__name__)

TASKED = frozenset({"required", "optional"})
_MIN_POLL_S, _MAX_POLL_S, _DEFAULT_POLL_S = 0.05, 5.0, 1.0
_MAX_RESULT_RETRIES = 5
"""How often a tasks/result whose stream broke is asked again (after a tasks/get) before the call fails."""
_LIST_AGAIN_S = 30.0
"""A tool the last tools/list did not show is looked up again at most this often."""
_MAX_LIST_PAGES = 50
_MAX_TOOLS = 10_000
_MAX_TASK_ID_CHARS = 1024
"""Longer upstream task ids are refused: they are logged and sent back on every tasks/get."""
_ids = itertools.count(1)


class LegacyUpstream(Protocol):
    """What a followed task needs of the 2025 upstream it runs on (legacy.LegacyUpstream, which imports this)."""

    initialize_result: dict[str, Any] | None

    @property
    def url(self) -> str: ...

    def spawn(self, coro: Awaitable[None]) -> None: ...

    async def ask(
        self,
        client_headers: MultiMapping[str],
        method: str,
        params: dict[str, Any],
        *,
        session: LegacySession | None = None,
        route: CallRoute | None = None,
    ) -> dict[str, Any] | None: ...

    def exchange(
        self,
        legacy: dict[str, Any],
        client_headers: MultiMapping[str],
        capabilities: dict[str, Any],
        *,
        max_bytes: int,
        route: CallRoute | None = None,
        session: LegacySession | None = None,
        verbatim: bool | None = None,
    ) -> AsyncIterator[Event]: ...


class TaskSupport:
    """What the upstream says of each tool's `execution.taskSupport`, learnt from its tools/list."""

    def __init__(self) -> None:
        self._by_tool: dict[str, str] = {}
        self._listed_at: float | None = None
        self._listing: asyncio.Future[None] | None = None

    def learn(self, result: dict[str, Any]) -> None:
        tools = result.get("tools")
        for tool in tools if isinstance(tools, list) else []:
            if len(self._by_tool) >= _MAX_TOOLS:
                return  # an upstream listing without end: what it says past this is not kept
            if isinstance(tool, dict) and isinstance(tool.get("name"), str):
                execution = tool.get("execution")
                support = execution.get("taskSupport") if isinstance(execution, dict) else None
                self._by_tool[tool["name"]] = support if isinstance(support, str) else "forbidden"

    async def of(self, legacy: LegacyUpstream, client_headers: MultiMapping[str], tool: str) -> str:
        """The tool's task support; "forbidden" when the server has no tasks for tools/call at all."""
        init = legacy.initialize_result or {}
        capabilities = init.get("capabilities") if isinstance(init.get("capabilities"), dict) else {}
        tasks = capabilities.get("tasks")
        requests = tasks.get("requests") if isinstance(tasks, dict) else None
        tools = requests.get("tools") if isinstance(requests, dict) else None
        if not (isinstance(tools, dict) and "call" in tools):
            return "forbidden"  # SEP-1686: without the capability, taskSupport is not to be used
        if tool not in self._by_tool and (
            self._listed_at is None or time.monotonic() - self._listed_at > _LIST_AGAIN_S
        ):
            if self._listing is None or self._listing.done():  # one listing at a time, which every caller waits on
                self._listing = asyncio.ensure_future(self._list(legacy, client_headers))
            await asyncio.shield(self._listing)
        return self._by_tool.get(tool, "forbidden")

    async def _list(self, legacy: LegacyUpstream, client_headers: MultiMapping[str]) -> None:
        try:
            await self._pages(legacy, client_headers)
        except UpstreamUnavailable as exc:
            # Unknown, not forbidden for good: the next call asks again. The call itself then reports the fault.
            log.warning("upstream_tools_unlisted", reason=str(exc))
            return
        self._listed_at = time.monotonic()

    async def _pages(self, legacy: LegacyUpstream, client_headers: MultiMapping[str]) -> None:
        cursor: Any = None
        for _ in range(_MAX_LIST_PAGES):
            params = {"cursor": cursor} if cursor is not None else {}
            answer = await legacy.ask(client_headers, "tools/list", params)
            result = answer.get("result") if answer else None
            if not isinstance(result, dict):
                return
            self.learn(result)
            cursor = result.get("nextCursor")
            if not isinstance(cursor, str):
                return


def without_task_support(result: dict[str, Any]) -> dict[str, Any]:
    """tools/list for a 2026-07-28 client: its Tool has no `execution.taskSupport` (tasks are the proxy's there)."""
    tools = result.get("tools")
    for tool in tools if isinstance(tools, list) else []:
        execution = tool.get("execution") if isinstance(tool, dict) else None
        if isinstance(execution, dict) and "taskSupport" in execution:
            execution = {key: value for key, value in execution.items() if key != "taskSupport"}
            if execution:
                tool["execution"] = execution
            else:
                del tool["execution"]
    return result


def _poll_s(task: dict[str, Any]) -> float:
    interval = task.get("pollInterval")
    if isinstance(interval, int | float) and not isinstance(interval, bool):
        try:
            seconds = float(interval) / 1000
        except OverflowError:  # an integer too large for a float: as long as allowed
            return _MAX_POLL_S
        if math.isfinite(seconds):  # NaN and infinities are no interval
            return min(max(seconds, _MIN_POLL_S), _MAX_POLL_S)
    return _DEFAULT_POLL_S


def _request(method: str, params: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": f"mtp-task-{next(_ids)}", "method": method, "params": params}


async def run_as_upstream_task(
    legacy: LegacyUpstream,
    session: LegacySession,
    legacy_message: dict[str, Any],
    client_headers: MultiMapping[str],
    capabilities: dict[str, Any],
    route: CallRoute,
    max_bytes: int,
    follow: UpstreamTask | None = None,
    detached: Callable[[], bool] | None = None,
) -> AsyncIterator[Event]:
    """The events of a tools/call run as the upstream's own task; the last is Finished or Failed. With `follow`,
    the task the server made for it before (through a replica that was lost) is followed, and nothing is sent.

    Stopped early, the call cancels the server's task (`tasks/cancel`), unless `detached()` says another replica
    goes on with it. A flag, read here at the end, rather than the cancellation's message: a call may be stopped
    while its consumer awaits something else, and then this generator only sees the GeneratorExit of its close."""
    task_id: str | None = None
    ended = False
    # The task request (the call with the server's default TTL: the proxy's own task bounds how long anyone waits).
    # The request is its own from here, and it lets go of it once sent (legacy.exchange): the server's task may run
    # for hours, and its arguments may be large.
    params = legacy_message.get("params") or {}
    create = None if follow is not None else {**legacy_message, "params": {**params, "task": {}}}
    del legacy_message, params
    try:
        if follow is not None:
            task: dict[str, Any] = {"taskId": follow.task_id, "status": "working"}
            log.info("upstream_task_followed", upstream_task_id=follow.task_id)
        else:
            assert create is not None
            created: Finished | None = None
            exchange = legacy.exchange(create, client_headers, capabilities, max_bytes=max_bytes, route=route)
            del create
            async for event in exchange:
                if isinstance(event, Finished):
                    created = event
                elif isinstance(event, Failed):
                    ended = True
                    yield event
                    return
                else:
                    yield event
            made = created.result.get("task") if created is not None else None
            if created is None or not isinstance(made, dict):
                ended = True  # the server answered the call itself, as a receiver without tasks may
                yield created if created is not None else proxy_failure("no answer to the task request", legacy.url)
                return
            if not isinstance(made.get("taskId"), str) or not 0 < len(made["taskId"]) <= _MAX_TASK_ID_CHARS:
                ended = True  # a task nobody can name cannot be followed, nor cancelled
                yield proxy_failure("the upstream's CreateTaskResult has no usable taskId", legacy.url)
                return
            task = made
            task_id = task["taskId"]  # from here, a call stopped cancels it (its consumer may stop at the next line)
            log.info("upstream_task_created", upstream_task_id=task_id, upstream_status=task.get("status"))
            yield Progress(
                None, upstream_task=UpstreamTask(task["taskId"], session.session_id, session.protocol_version)
            )
        task_id = task["taskId"]
        route.name_task(task_id)
        last_message: str | None = None
        result_failures = poll_failures = 0
        while True:
            status = task.get("status")
            message = task.get("statusMessage")
            if isinstance(message, str) and message != last_message:
                last_message = message
                yield Progress(message)
            if status in ("input_required", "completed", "failed"):
                # Blocks until the task ends; its input requests come on this stream (SEP-1686 side channel).
                outcome: Event | None = None
                result_request = _request("tasks/result", {"taskId": task_id})
                # On the session the task belongs to (servers bind tasks to one), as its tasks/get polls are.
                async for event in legacy.exchange(
                    result_request,
                    client_headers,
                    capabilities,
                    max_bytes=max_bytes,
                    route=route,
                    session=session,
                    verbatim=False,
                ):
                    if isinstance(event, Finished | Failed):
                        outcome = event
                    else:
                        yield event
                if isinstance(outcome, Finished):
                    ended = True
                    yield Finished(without_meta_key(outcome.result, RELATED_TASK), outcome.size)
                    return
                if isinstance(outcome, Failed) and not outcome.unread:
                    ended = True  # exactly what the underlying call would have answered
                    yield outcome
                    return
                if isinstance(outcome, Failed) and outcome.transient == "unanswered":
                    # The server went away with the task in it (a stdio child that exited): a restarted one knows
                    # nothing of it, and the call may run again, unless it was a lost replica's.
                    ended = True
                    yield outcome if follow is None else _unknown(outcome)
                    return
                result_failures += 1
                if result_failures > _MAX_RESULT_RETRIES:  # the task may still run upstream: it is cancelled there
                    failed = outcome or proxy_failure("tasks/result never answered", legacy.url)
                    # A tasks/result that never left is no call that never left: the call made its task.
                    failed = dataclasses.replace(failed, transient=None) if failed.transient == "unsent" else failed
                    yield failed if follow is None else _unknown(failed)
                    return
            elif status == "cancelled":
                ended = True
                reason = "the upstream cancelled its task"
                yield Failed(error_object(INTERNAL_ERROR, f"Upstream failure: {reason}"), reason)
                return
            await asyncio.sleep(max(_poll_s(task), _backoff_s(poll_failures)))
            try:
                answer = await legacy.ask(
                    client_headers, "tasks/get", {"taskId": task_id}, session=session, route=route
                )
                unread = None
            except UpstreamUnavailable as exc:
                answer, unread = None, proxy_failure(f"the upstream's tasks/get failed ({exc})", legacy.url)
            error = answer.get("error") if answer else None
            if isinstance(error, dict) and not isinstance(answer.get("result"), dict):  # type: ignore[union-attr]
                ended = True  # the upstream knows no such task any more: nothing to cancel
                failed = Failed(error, f"the upstream's tasks/get answered JSON-RPC error {error.get('code')}")
                yield failed if follow is None else _unknown(failed)
                return
            if answer is None or not isinstance(answer.get("result"), dict):
                # A blip (a restart, a load balancer's 503): the task goes on upstream, so it is asked again, a
                # few times, with growing waits; nothing is sent again.
                poll_failures += 1
                if poll_failures > _MAX_RESULT_RETRIES:
                    failed = unread or proxy_failure("the upstream's tasks/get gave no answer", legacy.url)
                    yield failed if follow is None else _unknown(failed)
                    return
                continue
            poll_failures = 0
            task = answer["result"]
    finally:
        if task_id is not None and not ended and not (detached is not None and detached()):
            legacy.spawn(_cancel(legacy, session, client_headers, task_id, route))


def _backoff_s(failures: int) -> float:
    return 0.0 if failures == 0 else min(0.25 * 2**failures, _MAX_POLL_S)


def _unknown(failed: Failed) -> Failed:
    """Following a server's task made through a lost replica failed (the server lost the session or the task, or
    stopped answering): what the call did upstream is not known, as for any lost replica's call not run again."""
    reason = (
        f"following the upstream's own task after a lost proxy replica failed ({failed.status_message}); the call "
        "may or may not have taken effect upstream"
    )
    data = failed.error.get("data")
    upstream = data.get("upstream") if isinstance(data, dict) else None
    extra = {"outcome": "unknown", "upstream": upstream} if isinstance(upstream, str) else {"outcome": "unknown"}
    return Failed(error_object(INTERNAL_ERROR, f"Proxy failure: {reason}", extra), reason, unread=True)


async def _cancel(
    legacy: LegacyUpstream, session: LegacySession, client_headers: MultiMapping[str], task_id: str, route: CallRoute
) -> None:
    try:
        answer = await legacy.ask(client_headers, "tasks/cancel", {"taskId": task_id}, session=session, route=route)
    except UpstreamUnavailable as exc:
        log.warning("upstream_task_cancel_not_delivered", upstream_task_id=task_id, reason=str(exc))
        return
    log.info("upstream_task_cancelled", upstream_task_id=task_id, answered=bool(answer and "result" in answer))
