"""One or several children of the same stdio server, and which one each request goes to.

On stdio a server's request (elicitation, sampling, roots) names no call, so with two calls in flight on one child
that may ask, the proxy cannot tell whose it is and refuses it (routing.py). `dispatch: exclusive` avoids that: a
call that may ask goes to a child with no other such call in flight, waiting for one to be free; `children` says
how many there are. `shared` (the default) sends everything to the child with the fewest requests in flight.
Requests of one call (a SEP-1686 task's follow-ups) stay on the child that took its first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from .routing import CallRoute
from .stdio_channel import ChildGone, Exchange, StdioChannel, may_ask
from .stdio_process import ChildSpec


class StdioPool:
    def __init__(self, spec: ChildSpec, *, children: int, exclusive: bool, max_in_flight: int) -> None:
        self.name = spec.name
        self.channels = [StdioChannel(spec, max_in_flight=max_in_flight, index=i) for i in range(children)]
        self.exclusive = exclusive
        self._max_waiting = max_in_flight
        self._waiting = 0
        self._freed = asyncio.Condition()
        for channel in self.channels:
            channel.on_forget.append(self._forgotten)

    def on_notification(self, callback: Callable[[dict[str, Any]], None]) -> None:
        for channel in self.channels:
            channel.on_notification.append(callback)

    def set_prepare(self, prepare: Any) -> None:
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
        if route is not None:
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
        if not (self.exclusive and may_ask(message.get("method"))):
            return self._least_busy(), False
        if self._waiting >= self._max_waiting:
            raise ChildGone(f"{self._waiting} calls wait for a free stdio child (upstream.stdio.children)")
        self._waiting += 1
        try:
            async with self._freed:
                await self._freed.wait_for(lambda: self._free() is not None)
                channel = self._free()
                assert channel is not None
                channel.reserved += 1  # taken before the request is written, so no second call picks it meanwhile
                return channel, True
        finally:
            self._waiting -= 1

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
