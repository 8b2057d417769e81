"""Which call a server's request belongs to when nothing on the wire ties it to one: a 2025 server's request on the
standalone GET stream, or any request of a stdio child (stdio has no per-call stream).

Its `related-task` metadata may name a task the proxy follows; otherwise, when exactly one call is in flight, it is
that call's. Anything else cannot be told, and the proxy refuses the request with the reason.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from .events import InputNeeded

RELATED_TASK = "io.modelcontextprotocol/related-task"

_QUIET_METHODS = frozenset(
    {
        "initialize",
        "ping",
        "tools/list",
        "prompts/list",
        "resources/list",
        "resources/templates/list",
        "logging/setLevel",
        "resources/subscribe",
        "resources/unsubscribe",
        "tasks/get",
        "tasks/list",
        "tasks/cancel",
        "server/discover",
        "subscriptions/listen",
    }
)
"""Requests during which a server does not ask its client anything: never the call an untied request is for."""


def may_ask(method: Any) -> bool:
    """Whether a server may ask its client something while it answers this request."""
    return method not in _QUIET_METHODS


_ASKED_KINDS = ("elicitation", "sampling", "roots")


def asks_client(method: Any, capabilities: dict[str, Any]) -> bool:
    """Whether a server may put a question to this request's client: a request during which servers ask, from a
    client that declared a kind of question the proxy relays (any other is declined without the client)."""
    return may_ask(method) and any(kind in capabilities for kind in _ASKED_KINDS)


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
    watchers: list[Callable[[CallRoute], None]] = dataclasses.field(default_factory=list)
    """The indexes the call is in (CallsInFlight, stdio's InFlight), told when its upstream task is named."""
    caller: str = ""
    """Who the call is for (security.caller_of): the upstream sessions and stdio children it may use are theirs."""
    asks: bool = False
    """Its client may be asked something (asks_client): it never shares a session with another call."""

    def name_task(self, task_id: str) -> None:
        """The upstream made its task for this call: from now the task id finds it."""
        self.upstream_task_id = task_id
        for watcher in list(self.watchers):
            watcher(self)


class Followers:
    """Calls in flight by the upstream task they follow, kept as each is named (`watch` makes `add` a watcher that
    CallRoute.name_task tells); two may follow one task: the first named is found."""

    def __init__(self) -> None:
        self._routes: dict[str, list[CallRoute]] = {}

    def watch(self, route: CallRoute) -> None:
        """Index `route` by its upstream task from when it is named (now, if it is)."""
        route.watchers.append(self.add)
        if route.upstream_task_id is not None:
            self.add(route)

    def unwatch(self, route: CallRoute) -> None:
        """The call left: no longer told of its task, nor found by it."""
        route.watchers.remove(self.add)
        self.discard(route)

    def add(self, route: CallRoute) -> None:
        assert route.upstream_task_id is not None
        routes = self._routes.setdefault(route.upstream_task_id, [])
        if route not in routes:
            routes.append(route)

    def discard(self, route: CallRoute) -> None:
        task_id = route.upstream_task_id
        routes = self._routes.get(task_id) if task_id is not None else None
        if routes is not None and route in routes:
            routes.remove(route)
            if not routes:
                del self._routes[task_id]  # type: ignore[arg-type]

    def first(self, task_id: str) -> CallRoute | None:
        routes = self._routes.get(task_id)
        return routes[0] if routes else None


class CallsInFlight:
    """A session's calls in flight by upstream request id (a call may have several requests: an upstream task's
    follow-ups), with its distinct calls counted and indexed by upstream task id as each is named: a server's
    request on the standalone stream finds its call without a scan of every call on the session."""

    def __init__(self) -> None:
        self._by_request: dict[Any, CallRoute] = {}
        self._routes: dict[int, list[Any]] = {}
        """The distinct calls, oldest first: id(route) -> [route, how many request ids name it]."""
        self._by_task = Followers()
        self.asking = 0
        """Distinct calls whose client may be asked something (CallRoute.asks)."""

    def __bool__(self) -> bool:
        return bool(self._by_request)

    def __len__(self) -> int:
        return len(self._by_request)

    def __setitem__(self, request_id: Any, route: CallRoute) -> None:
        current = self._by_request.get(request_id)
        if current is route:
            return
        if current is not None:
            self.pop(request_id)
        self._by_request[request_id] = route
        entry = self._routes.get(id(route))
        if entry is not None:
            entry[1] += 1
            return
        self._routes[id(route)] = [route, 1]
        self.asking += route.asks
        self._by_task.watch(route)

    def pop(self, request_id: Any, default: CallRoute | None = None) -> CallRoute | None:
        route = self._by_request.pop(request_id, None)
        if route is None:
            return default
        entry = self._routes[id(route)]
        entry[1] -= 1
        if entry[1]:
            return route
        del self._routes[id(route)]
        self.asking -= route.asks
        self._by_task.unwatch(route)
        return route

    def following(self, task_id: str) -> CallRoute | None:
        """The call in flight that follows upstream task `task_id` (the first named, if several do)."""
        return self._by_task.first(task_id)

    def carries(self, route: CallRoute) -> bool:
        """Whether `route`'s call is in flight here."""
        return id(route) in self._routes

    @property
    def distinct(self) -> int:
        return len(self._routes)

    def only(self) -> CallRoute | None:
        """The one call in flight, when there is exactly one."""
        return next(iter(self._routes.values()))[0] if len(self._routes) == 1 else None


@dataclasses.dataclass(slots=True)
class LegacySession:
    """A 2025-era session as the proxy holds it: with a 2025 server (its own, each for one caller: `principal` says
    whose), or a 2025 client's."""

    session_id: str | None
    protocol_version: str
    principal: str
    calls: CallsInFlight = dataclasses.field(default_factory=CallsInFlight)
    """The calls in flight, by upstream request id: where a request on the standalone stream may belong."""
    reader: asyncio.Task[None] | None = None
    """Reads the session's standalone stream (upstream/http/standalone.py)."""
    refused: int = 0
    """Requests on the standalone stream the proxy could not relay (their log lines are thinned past a few)."""
    on_status: Callable[[int], None] | None = None
    """A client's own session (a durable call's): told the HTTP status the server answers each POST with."""
    number: int = 0
    """The proxy's own sessions with a 2025 server: its key in the table of CallerSessions."""
    carried: bool = False
    """A client's own session as a call's record carries it to the replica that runs the call (taken over, or
    queued): when that replica's server does not know it (a sidecar's, gone with its pod), the call goes over a
    session of the proxy's own for the caller instead."""


def related_task_id(message: dict[str, Any]) -> str | None:
    params = message.get("params")
    meta = params.get("_meta") if isinstance(params, dict) else None
    related = meta.get(RELATED_TASK) if isinstance(meta, dict) else None
    task_id = related.get("taskId") if isinstance(related, dict) else None
    return task_id if isinstance(task_id, str) else None


def route_for(in_flight: CallsInFlight, message: dict[str, Any]) -> tuple[CallRoute | None, str]:
    """The call (of a session's `in_flight`) a standalone request belongs to, or None and the reason it cannot be
    told."""
    task_id = related_task_id(message)
    only = in_flight.only()
    if task_id is not None:
        route = in_flight.following(task_id)
        if route is not None:
            return route, ""
        if only is not None and only.upstream_task_id is None:
            return only, ""  # the one call whose task is being made: the request came before the task's id
        return None, f"it names task {task_id!r}, which no call of this proxy session follows"
    if only is not None:
        return only, ""
    if not in_flight.distinct:
        return None, "no call is in flight on this proxy session"
    return None, f"{in_flight.distinct} calls are in flight on this proxy session and the request names none of them"
