"""`subscriptions/listen` with `notifications.taskIds`: push task state instead of polling (SEP-2663).

The stream opens with `notifications/subscriptions/acknowledged` (the granted subset), then carries
`notifications/tasks` with the full DetailedTask whenever a granted task changes, on any replica. Other notification
types the client asks for are the upstream's: the same request goes upstream for those, and both streams are merged.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import structlog
from aiohttp import web

from ..jsonrpc import INVALID_PARAMS, JsonRpcError
from ..store.base import StoreUnavailable, TaskStore
from ..tasks.model import TaskRecord, is_task_id
from ..tasks.runner import TaskRunner
from ..upstream.http.sse import KEEP_ALIVE, message_event

log = structlog.get_logger(__name__)

SUBSCRIPTION_ID = "io.modelcontextprotocol/subscriptionId"
KEEPALIVE_S = 15.0
MAX_TASK_IDS = 1000
"""Tasks one subscriptions/listen may name: each is watched, and read from the store, while its stream is open."""


def parse_filter(params: dict[str, Any]) -> tuple[list[str] | None, dict[str, Any]]:
    """(taskIds or None, the rest of the filter); -32602 for a filter that is not an object or bad taskIds."""
    notifications = params.get("notifications")
    if not isinstance(notifications, dict):
        raise JsonRpcError(INVALID_PARAMS, "Invalid params: notifications must be an object")
    task_ids = notifications.get("taskIds")
    if task_ids is not None and not (isinstance(task_ids, list) and all(isinstance(t, str) for t in task_ids)):
        raise JsonRpcError(INVALID_PARAMS, "Invalid params: notifications.taskIds must be an array of strings")
    if task_ids is not None and len(task_ids) > MAX_TASK_IDS:
        # Each id is watched, and read from the store, for as long as the stream is open.
        raise JsonRpcError(
            INVALID_PARAMS,
            f"Invalid params: notifications.taskIds lists {len(task_ids)} tasks; one subscription follows at most "
            f"{MAX_TASK_IDS}",
            {"maxTaskIds": MAX_TASK_IDS},
        )
    rest = {key: value for key, value in notifications.items() if key != "taskIds"}
    return (list(dict.fromkeys(task_ids)) if task_ids is not None else None), rest


def wants_upstream(rest: dict[str, Any]) -> bool:
    return any(value not in (False, None, [], {}) for value in rest.values())


async def granted_tasks(store: TaskStore, task_ids: list[str], principal: str) -> dict[str, TaskRecord]:
    """Only the caller's own tasks are granted; the others are silently left out, as if unknown."""
    granted: dict[str, TaskRecord] = {}
    for task_id in filter(is_task_id, task_ids):
        record = await store.get(task_id)
        if record is not None and record.principal == principal:
            granted[task_id] = record
    return granted


def _notification(method: str, params: dict[str, Any], subscription_id: Any) -> bytes:
    message = {"jsonrpc": "2.0", "method": method, "params": {**params, "_meta": {SUBSCRIPTION_ID: subscription_id}}}
    return message_event(message)


async def stream(
    request: web.Request,
    message: dict[str, Any],
    *,
    runner: TaskRunner,
    store: TaskStore,
    principal: str,
    task_ids: list[str],
    upstream_events: AsyncGenerator[dict[str, Any], None] | None,
) -> web.StreamResponse:
    """Serve one subscription until the client leaves, or (with no upstream part) every granted task is terminal."""
    subscription_id = message["id"]
    # Before reading state: no change can slip between the two. Progress too (a new statusMessage is a change of
    # the task): on this replica at once; a listener on another replica reads it at its next tick.
    queue = runner.watchers.watch(task_ids, progress=True)
    try:
        acknowledged: dict[str, Any] = {}
        first = None
        if upstream_events is not None:
            # Read first: a generator never started does not run its cleanup on aclose (the upstream stream would
            # stay open if what follows failed).
            first = await anext(upstream_events, None)
        granted = await granted_tasks(store, task_ids, principal)
        if first is not None and first.get("method") == "notifications/subscriptions/acknowledged":
            acknowledged = dict((first.get("params") or {}).get("notifications") or {})
        if task_ids:
            acknowledged["taskIds"] = list(granted)
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        await response.prepare(request)
        await response.write(
            _notification("notifications/subscriptions/acknowledged", {"notifications": acknowledged}, subscription_id)
        )
        sent: dict[str, Any] = {}
        for task_id, record in granted.items():  # the state now, so a client that subscribes late misses nothing
            await response.write(_notification("notifications/tasks", record.to_wire(), subscription_id))
            if not record.is_terminal:
                sent[task_id] = record.last_updated_at
        await _serve(response, queue, store, principal, sent, subscription_id, upstream_events, runner.stopping)
        result = {"resultType": "complete", "_meta": {SUBSCRIPTION_ID: subscription_id}}
        await response.write(message_event({"jsonrpc": "2.0", "id": subscription_id, "result": result}))
        await response.write_eof()
        return response
    finally:
        runner.watchers.unwatch(task_ids, queue)
        if upstream_events is not None:
            await upstream_events.aclose()


async def _serve(
    response: web.StreamResponse,
    queue: asyncio.Queue[str],
    store: TaskStore,
    principal: str,
    open_tasks: dict[str, Any],
    subscription_id: Any,
    upstream_events: AsyncIterator[dict[str, Any]] | None,
    stopping: asyncio.Event,
) -> None:
    """Until every open task is terminal (and the upstream part ended), or the proxy stops: each change of an open
    task goes out once. A stop ends the subscription as the spec's graceful close does (its result), so that the
    client listens again, elsewhere, instead of holding the proxy's stop for its whole grace.

    `open_tasks` maps each granted, unfinished task to the lastUpdatedAt last sent. Besides change events, every
    keep-alive tick re-reads the open tasks: an event lost between replicas (a dropped subscription, a failed
    publish) delays a notification by one tick at most, never forever."""
    upstream_next: asyncio.Future[dict[str, Any] | None] | None = (
        asyncio.ensure_future(anext(upstream_events, None)) if upstream_events is not None else None
    )

    async def send_if_changed(task_id: str) -> None:
        if task_id not in open_tasks:
            return
        try:
            record = await store.get(task_id)
        except StoreUnavailable:
            return  # logged by the store; the stream stays open and the next tick reads again
        if record is not None and record.principal != principal:
            record = None  # only ever the caller's own task (ids are unique; this is the second lock on the door)
        if record is not None and record.last_updated_at != open_tasks[task_id]:
            await response.write(_notification("notifications/tasks", record.to_wire(), subscription_id))
            open_tasks[task_id] = record.last_updated_at
        if record is None or record.is_terminal:
            open_tasks.pop(task_id, None)

    changed: asyncio.Future[str] | None = None
    stopped = asyncio.ensure_future(stopping.wait())
    try:
        while (open_tasks or upstream_next is not None) and not stopping.is_set():
            changed = asyncio.ensure_future(queue.get())
            waiting = {changed, stopped} | ({upstream_next} if upstream_next is not None else set())
            done, _ = await asyncio.wait(waiting, timeout=KEEPALIVE_S, return_when=asyncio.FIRST_COMPLETED)
            if stopped in done:
                break
            if not done:
                changed.cancel()
                await response.write(KEEP_ALIVE)
                for task_id in list(open_tasks):
                    await send_if_changed(task_id)
                continue
            if changed in done:
                await send_if_changed(changed.result())
            else:
                changed.cancel()
            if upstream_next is not None and upstream_next in done:
                upstream_message = upstream_next.result()
                if upstream_message is None or "method" not in upstream_message:
                    upstream_next = None  # the upstream ended its part of the subscription
                else:
                    await response.write(message_event(upstream_message))
                    upstream_next = asyncio.ensure_future(anext(upstream_events, None))  # type: ignore[arg-type]
    finally:
        # Whatever still waits is cancelled, also when the client left mid-wait (the handler cancelled): a pending
        # get would be destroyed with the loop at the proxy's stop.
        stopped.cancel()
        if changed is not None:
            changed.cancel()
        if upstream_next is not None:
            upstream_next.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await upstream_next
