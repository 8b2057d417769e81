"""The lane's protocol factory: a connection protocol per client connection (proxy/front/lane/connection.py, given to it
by proxy/front/lane/__init__.py), the one timer of their deadlines, and the hand-over of a connection to aiohttp."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from email.utils import formatdate
from typing import Protocol

from aiohttp import web

from ...upstream.http.relay import HttpRelay
from ..context import (
    bridge_key,
    concurrency_key,
    gateway_key,
    guard_key,
    identity_key,
    metrics_key,
    policy_key,
    rates_key,
    runner_key,
    tasks2026_key,
)

_SWEEP_S = 0.25
_OWED_RECHECK_S = 0.1
"""While stopping: how often to look again whether answers are still owed (Lane.shutdown)."""


class LaneConnection(Protocol):
    """What the lane asks of a connection it serves."""

    deadline: float
    running: asyncio.Task[None] | None

    def expired(self) -> None: ...

    def close_when_idle(self) -> None: ...

    def abort(self) -> None: ...


class Lane:
    """The protocol factory of the listening socket: a `LaneConnection` per client connection, each handed to
    `handlers` (aiohttp's web.Server) when it carries a request the lane does not read; the application's handler
    (`handlers.request_handler`) answers on the lane's connection what the lane reads but does not serve."""

    def __init__(
        self,
        app: web.Application,
        handlers: web.Server,
        connection: Callable[[Lane], LaneConnection],
        *,
        header_timeout_s: float,
    ) -> None:
        """`app` has started: what each request needs of it is looked up once, here (the policy's config is read
        at every request, as a reload replaces it)."""
        self.handlers = handlers
        self._connection = connection
        self.header_timeout_s = header_timeout_s
        self.connections: set[LaneConnection] = set()
        self.admit: Callable[[asyncio.Transport], bool] = lambda transport: True
        """The connection cap (proxy/front/serve.py): False when this connection was refused and closed."""
        self.policy = app[policy_key]
        self.gateway = app[gateway_key]
        self.guard = app[guard_key]
        self.rates = app[rates_key]
        self.concurrency = app[concurrency_key]
        self.metrics = app[metrics_key]
        self.identity = app[identity_key]
        self.verifier = self.identity.verifier
        self.bridge = app[bridge_key]
        self.runner = app[runner_key]
        self.precedence = self.runner.precedence
        self.tasks2026 = app[tasks2026_key]
        self.routes_sessions = app[policy_key].config.listen.advertise_url is not None
        """Replicas route 2025 sessions and parked calls (proxy/front/session_routing.py): requests that may name either
        are aiohttp's, which routes them."""
        self.loop = asyncio.get_running_loop()
        self._date = ("", 0)
        self._sweep: asyncio.TimerHandle | None = None
        self.counts = {"relayed": 0, "served": 0, "handled": 0, "handed_over": 0}
        """Requests the lane relayed, requests it served itself (tasks/*, task creation), requests the application's
        handler answered on its connections (proxy/front/lane/handlers.py), and connections it handed to aiohttp
        for good."""
        self.own = False
        """Set while aiohttp is given a connection the lane admitted already (proxy/front/serve.py's cap skips it)."""
        self.metrics.watch("mcp_tasks_proxy_lane", "Requests the lane relayed without aiohttp (relayed), the "
                           "proxy's own it answered without aiohttp (served), requests it read that the application's "
                           "handler answered (handled), and connections it handed to aiohttp (handed_over)", "outcome",
                           lambda: self.counts, counter=True)  # fmt: skip

    def __call__(self) -> LaneConnection:
        if self._sweep is None:
            self._sweep = self.loop.call_later(_SWEEP_S, self._expire)
        return self._connection(self)

    def route(self) -> str | None:
        """How a request the proxy does not own may be relayed here now: "modern" (to a 2026 HTTP upstream, as
        received), "legacy" (bridged to a 2025-era one, over either transport), or None: aiohttp's."""
        era = self.gateway.known_era
        if era == "modern":
            return era if isinstance(self.gateway.relay, HttpRelay) else None
        return era

    def _expire(self) -> None:
        """One timer for every connection's head and body deadlines: a timer per request costs more than the
        sweep, and a deadline met a fraction of a second late changes nothing."""
        now = self.loop.time()
        for connection in [c for c in self.connections if c.deadline <= now]:
            connection.expired()
        self._sweep = self.loop.call_later(_SWEEP_S, self._expire)

    def hand_over(self, connection: LaneConnection, transport: asyncio.Transport, data: bytes) -> None:
        """Give the connection, and the bytes of the request it is reading, to aiohttp."""
        self.connections.discard(connection)
        self.counts["handed_over"] += 1
        self.own = True  # an admitted connection changing hands: the cap does not judge it again
        try:
            handler = self.handlers()
            handler.connection_made(transport)
        finally:
            self.own = False
        transport.set_protocol(handler)
        if data:
            handler.data_received(data)

    def date(self) -> str:
        now = int(time.time())
        if self._date[1] != now:
            self._date = (formatdate(now, usegmt=True), now)
        return self._date[0]

    async def shutdown(self, timeout_s: float) -> None:
        """Stop: idle connections close now, answers still owed get up to `timeout_s`."""
        if self._sweep is not None:
            self._sweep.cancel()
        for connection in list(self.connections):
            connection.close_when_idle()
        deadline = self.loop.time() + timeout_s
        while running := [c.running for c in self.connections if c.running is not None]:
            left = deadline - self.loop.time()
            if left <= 0:
                break
            # Another task may answer a request (a bridged call's question taken over: proxy/upstream/bridge.py),
            # and the request's own task may end before or after that answer: what is owed is the answer, so look
            # again now and then, woken early by a request task that ends, never by one that has ended.
            pending = [task for task in running if not task.done()]
            if pending:
                await asyncio.wait(pending, timeout=min(left, _OWED_RECHECK_S))
            else:
                await asyncio.sleep(min(left, _OWED_RECHECK_S))
        for connection in list(self.connections):
            connection.abort()
