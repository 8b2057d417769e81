"""Which call a server's request belongs to when nothing on the wire ties it to one: a 2025 server's request on the
standalone GET stream, or any request of a stdio child (stdio has no per-call stream).

Its `related-task` metadata may name a task the proxy follows; otherwise, when exactly one call is in flight, it is
that call's. Anything else cannot be told, and the proxy refuses the request with the reason.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from .events import InputNeeded

RELATED_TASK = "io.modelcontextprotocol/related-task"


@dataclasses.dataclass(eq=False, slots=True)
class CallRoute:
    """A call in flight on a session, as the standalone stream needs to know it."""

    capabilities: dict[str, Any]
    on_request: Callable[[InputNeeded], Awaitable[None]] | None
    """Where a request tied to this call goes; None when its caller cannot take input from outside its stream."""
    upstream_task_id: str | None = None
    """The SEP-1686 task the upstream made for this call, once known."""
    upstream_task: bool = False
    """The call runs as the server's own SEP-1686 task (its id, upstream_task_id, not yet known at first)."""
    affinity: int | None = None
    """stdio: the child (of a pool) that took the call's first request, where the rest of it goes too."""


@dataclasses.dataclass(slots=True)
class LegacySession:
    """A 2025-era session as the proxy holds it: with a 2025 server (its own, one per caller), or a 2025 client's."""

    session_id: str | None
    protocol_version: str
    principal: str
    calls: dict[Any, CallRoute] = dataclasses.field(default_factory=dict)
    """The calls in flight, by upstream request id: where a request on the standalone stream may belong."""
    reader: asyncio.Task[None] | None = None
    """Reads the session's standalone stream (upstream/http/standalone.py)."""
    refused: int = 0
    """Requests on the standalone stream the proxy could not relay (their log lines are thinned past a few)."""
    on_status: Callable[[int], None] | None = None
    """A client's own session (a durable call's): told the HTTP status the server answers each POST with."""


def related_task_id(message: dict[str, Any]) -> str | None:
    params = message.get("params")
    meta = params.get("_meta") if isinstance(params, dict) else None
    related = meta.get(RELATED_TASK) if isinstance(meta, dict) else None
    task_id = related.get("taskId") if isinstance(related, dict) else None
    return task_id if isinstance(task_id, str) else None


def route_for(in_flight: Iterable[CallRoute], message: dict[str, Any]) -> tuple[CallRoute | None, str]:
    """The call (of a session's `in_flight`) a standalone request belongs to, or None and the reason it cannot be
    told."""
    calls = list({id(route): route for route in in_flight}.values())  # a call may have several POSTs
    task_id = related_task_id(message)
    if task_id is not None:
        for route in calls:
            if route.upstream_task_id == task_id:
                return route, ""
        if len(calls) == 1 and calls[0].upstream_task_id is None:
            return calls[0], ""  # the one call whose task is being made: the request came before the task's id
        return None, f"it names task {task_id!r}, which no call of this proxy session follows"
    if len(calls) == 1:
        return calls[0], ""
    if not calls:
        return None, "no call is in flight on this proxy session"
    return None, f"{len(calls)} calls are in flight on this proxy session and the request names none of them"
