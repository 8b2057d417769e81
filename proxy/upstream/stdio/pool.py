"""One or several children of the same stdio server, and which one each request goes to.

On stdio a server's request (elicitation, sampling, roots) names no call, so with two calls in flight on one child
that may ask, the proxy cannot tell whose it is and refuses it (routing.py). Two rules keep one caller's question
from making another's unanswerable:

- `shared` (the default) sends each request to the child with the fewest in flight, except that a call that may ask
  never goes to a child with a question open: that child waits on one caller's answer, and any question it sends
  meanwhile must be that caller's (an abandoned question would otherwise make every other caller's questions
  ambiguous for as long as it stays open). When every child has one open, another child is started, up to
  `max_children`; past that the least busy child takes the call, as before.
- `exclusive`: a call that may ask goes to a child with no other such call in flight, starting another child up to
  `max_children`, else waiting for one to be free.

`children` are started at once; the others when needed, and they stay. Requests of one call (a SEP-1686 task's
follow-ups) stay on the child that took its first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import structlog

from ..routing import CallRoute
from .channel import StdioChannel
from .exchange import ChildUnavailable, Exchange, may_ask
from .process import ChildSpec

log = structlog.get_logger(__name__)


class StdioPool:
    def __init__(
        self, spec: ChildSpec, *, children: int, exclusive: bool, max_in_flight: int, max_children: int | None = None
    ) -> None:
        self.name = spec.name
        self._spec = spec
        self._max_in_flight = max_in_flight
        self.max_children = max(children, max_children or children)
        self._on_notification: list[Callable[[dict[str, Any]], None]] = []
        self._prepare: Any = None
        self.channels = [self._channel(i) for i in range(children)]
        self.exclusive = exclusive
        self._max_waiting = max_in_flight
        self._waiting = 0
        self._freed = asyncio.Condition()
        self._growing = asyncio.Lock()
        self._stopping = False

    def _channel(self, index: int) -> StdioChannel:
        channel = StdioChannel(self._spec, max_in_flight=self._max_in_flight, index=index)
        channel.on_forget.append(self._forgotten)
        channel.on_notification.extend(self._on_notification)
        channel.prepare = self._prepare
        return channel

    def on_notification(self, callback: Callable[[dict[str, Any]], None]) -> None:
        self._on_notification.append(callback)
        for channel in self.channels:
            channel.on_notification.append(callback)

    def set_prepare(self, prepare: Any) -> None:
        self._prepare = prepare
        for channel in self.channels:
            channel.prepare = prepare

    async def start(self) -> None:
        try:
            for channel in self.channels:
                await channel.start()  # OSError for a program that cannot start: the first child says it
        except OSError:
            await self.stop()  # the children already started go too
            raise

    async def stop(self) -> None:
        self._stopping = True
        async with self._growing:  # a child being added is stopped with the rest
            await asyncio.gather(*(channel.stop() for channel in self.channels))

    @property
    def state(self) -> str:
        """ "running", or what the first child that does not run says."""
        for channel in self.channels:
            if channel.supervisor.child is None:
                return channel.supervisor.state
        return "running"

    @property
    def in_flight(self) -> int:
        return sum(channel.in_flight for channel in self.channels)

    async def prepared(self, wait_s: float) -> Any:
        """A running child, prepared (what its prepare hook returned)."""
        return await self._least_busy().prepared(wait_s)

    async def request(
        self, message: dict[str, Any], *, route: CallRoute | None = None, wait_s: float = 30.0, prepared: bool = True
    ) -> Exchange:
        channel, reserved = await self._pick(message, route)
        if route is not None and route.affinity is None:
            route.affinity = channel.index
        try:
            return await channel.request(message, route=route, wait_s=wait_s, prepared=prepared)
        finally:
            if reserved:  # in flight now (counted by channel.asking), or failed: either way no longer reserved
                channel.reserved -= 1
                self._wake()

    async def notify(self, message: dict[str, Any]) -> None:
        await asyncio.gather(*(channel.notify(message) for channel in self.channels))

    async def respond(self, shown_id: Any, answer: dict[str, Any]) -> bool:
        for channel in self.channels:
            if channel.owns(shown_id):
                return await channel.respond(shown_id, answer)
        return False

    async def _pick(self, message: dict[str, Any], route: CallRoute | None) -> tuple[StdioChannel, bool]:
        """The child for this request, and whether it was reserved for it (exclusive dispatch)."""
        if route is not None and route.affinity is not None:
            return self.channels[route.affinity], False
        if not may_ask(message.get("method")):
            return self._least_busy(), False
        if not self.exclusive:
            channel = self._without_questions() or await self._grow(self._without_questions)
            return channel or self._least_busy(), False
        if self._waiting >= self._max_waiting:
            raise ChildUnavailable(f"{self._waiting} calls wait for a free stdio child (upstream.stdio.children)")
        self._waiting += 1
        try:
            if self._free() is None:
                await self._grow(self._free)
            async with self._freed:
                await self._freed.wait_for(lambda: self._free() is not None)
                channel = self._free()
                assert channel is not None
                channel.reserved += 1  # taken before the request is written, so no second call picks it meanwhile
                return channel, True
        finally:
            self._waiting -= 1

    async def _grow(self, found: Callable[[], StdioChannel | None]) -> StdioChannel | None:
        """Start one more child, unless `found` finds one after all (another call grew the pool meanwhile) or the
        pool is at max_children; the new child, or None."""
        async with self._growing:
            channel = found()
            if channel is not None or len(self.channels) >= self.max_children or self._stopping:
                return channel
            channel = self._channel(len(self.channels))
            try:
                await channel.start()
            except OSError as exc:
                log.warning("stdio_child_not_added", upstream=self.name, reason=str(exc))
                return None
            self.channels.append(channel)
            log.info("stdio_child_added", upstream=self.name, children=len(self.channels), max=self.max_children)
            self._wake()
            return channel

    def _without_questions(self) -> StdioChannel | None:
        """The least busy child with no question of its own open (a running one first: one that is restarting
        has none open either, and is no reason to start another), if any."""
        calm = [channel for channel in self.channels if channel.open_questions == 0]
        running = [channel for channel in calm if channel.supervisor.child is not None]
        return min(running or calm, key=lambda channel: channel.in_flight) if calm else None

    def _free(self) -> StdioChannel | None:
        free = [channel for channel in self.channels if channel.asking + channel.reserved == 0]
        running = [channel for channel in free if channel.supervisor.child is not None]
        return (running or free or [None])[0]

    def _least_busy(self) -> StdioChannel:
        running = [channel for channel in self.channels if channel.supervisor.child is not None] or self.channels
        return min(running, key=lambda channel: channel.in_flight)

    def _forgotten(self, exchange: Exchange) -> None:
        if exchange.may_ask and self.exclusive:
            self._wake()

    def _wake(self) -> None:
        async def wake() -> None:
            async with self._freed:
                self._freed.notify_all()

        asyncio.ensure_future(wake())
