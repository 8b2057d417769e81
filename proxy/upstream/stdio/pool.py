"""One or several children of the same stdio server, and which one each request goes to.

Each child serves one caller (a principal, or an anonymous client's address) unless `share_children` says
otherwise: a server keeps what a client told it (the roots it was given, subscriptions, an open question), and on
stdio it cannot tell its clients apart. A caller with no child of its own free for a request takes a child nobody
has, starts one up to `max_children`, or has the idle child of another caller restarted for it (the state it kept
gone); past that the request waits for one (start_timeout_s), then fails saying why. The proxy's own requests
(a probe, a tools/list) may go to any child.

Among the children a caller may use, a server's request (elicitation, sampling, roots) names no call, so with two
calls in flight on one child that may ask, the proxy cannot tell whose it is and refuses it (routing.py). Two rules
keep one call's question from making another's unanswerable:

- `shared` (the default) sends each request to the child with the fewest in flight, except that a call that may ask
  never goes to a child with a question open: that child waits on one answer, and any question it sends meanwhile
  must be for that call. When every child has one open, another child is taken as above; past that the least busy
  child takes the call.
- `exclusive`: a call that may ask goes to a child with no other such call in flight, taking another child as
  above, else waiting for one to be free.

`children` are started at once; the others when needed, and they stay. Requests of one call (a SEP-1686 task's
follow-ups) stay on the child that took its first, while that child still serves the call's caller.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

import structlog

from ...clients.envelope import params_of
from ...clients.parking import ChildStates, invalid_state
from ...security import ANONYMOUS
from ..routing import CallRoute
from .channel import StdioChannel
from .exchange import ChildUnavailable, Exchange, may_ask
from .process import ChildSpec

log = structlog.get_logger(__name__)


class StdioPool:
    def __init__(
        self,
        spec: ChildSpec,
        *,
        children: int,
        exclusive: bool,
        max_in_flight: int,
        max_children: int | None = None,
        shared: bool = True,
        wait_s: float = 30.0,
    ) -> None:
        self.name = spec.name
        self._spec = spec
        self._max_in_flight = max_in_flight
        self.max_children = max(children, max_children or children)
        self._on_notification: list[Callable[[dict[str, Any]], None]] = []
        self._prepare: Any = None
        self.channels = [self._channel(i) for i in range(children)]
        self.exclusive = exclusive
        self.shared = shared
        """Children serve any caller (share_children); else each serves one caller at a time."""
        self._wait_s = wait_s
        self._max_waiting = max_in_flight
        self._waiting = 0
        self._freed = asyncio.Condition()
        self._changes = 0
        """Counts calls ended and children added: a caller waiting for a child looks again when it moved."""
        self._growing = asyncio.Lock()
        self._stopping = False
        self._restarts: set[asyncio.Task[None]] = set()
        self.states = ChildStates()
        """A 2026 child's own MRTR state, wrapped to name the copy (and replica) that can read it."""
        self.round_enders: list[Callable[[str | None], bool]] = []
        """End a parked MRTR round (the caller's oldest; None: anyone's): Gateway.ends_rounds."""

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
        await asyncio.gather(*self._restarts, return_exceptions=True)  # a child being restarted ends its stop

    @property
    def state(self) -> str:
        """ "running", or what the first child that does not run says."""
        for channel in self.channels:
            if channel.supervisor.child is None and not channel.supervisor.recycling:
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
        """Send `message` to the child it goes to; what the child writes for it comes on the Exchange. An MRTR
        round's requestState goes back to the copy that made it (ChildStates); an invalid one is refused (-32602)."""
        params = message.get("params")
        state = params.get("requestState") if isinstance(params, dict) else None
        binding = _binding(route, message)
        if self.states.owns(state):
            opened = self.states.open(state, binding)
            if opened is None:
                raise invalid_state()
            child, state = opened
            message = {**message, "params": {**params, "requestState": state}}  # type: ignore[dict-item]
            route = route or CallRoute({}, None)
            route.affinity = child if child < len(self.channels) else None
        channel, reserved = await self._pick(message, route)
        if route is not None and route.affinity is None:
            route.affinity = channel.index
        seal = functools.partial(self.states.seal, child=channel.index, binding=binding)
        try:
            return await channel.request(message, route=route, wait_s=wait_s, prepared=prepared, seal_state=seal)
        finally:
            if reserved:  # in flight now (counted by channel.asking), or failed: either way no longer reserved
                channel.reserved -= 1
                self._wake()

    async def notify(self, message: dict[str, Any], caller: str = "") -> None:
        """A notification to the children: a caller's goes to its own only (unless children are shared)."""
        mine = self.channels if self.shared or not caller else self._of(caller)
        await asyncio.gather(*(channel.notify(message) for channel in mine))

    async def respond(self, shown_id: Any, answer: dict[str, Any]) -> bool:
        for channel in self.channels:
            if channel.owns(shown_id):
                return await channel.respond(shown_id, answer)
        return False

    async def _pick(self, message: dict[str, Any], route: CallRoute | None) -> tuple[StdioChannel, bool]:
        """The child for this request, and whether it was reserved for it (exclusive dispatch)."""
        caller = route.caller if route is not None and not self.shared else ""
        if route is not None and route.affinity is not None:
            channel = self.channels[route.affinity]
            if not caller or channel.owner == caller:
                return channel, False
            # (Restarted for another caller since: the call's state there is gone, and asking is its own child's.)
        if not caller:
            return await self._pick_among(message)
        mine = self._of(caller) or self._unowned(caller)
        found = self._fitting(message, mine) if mine else None
        if found is not None:  # most requests: a child of the caller's own fits, no waiting
            return found, self.exclusive and may_ask(message.get("method"))
        if self._waiting >= self._max_waiting:
            raise ChildUnavailable(f"{self._waiting} calls wait for a free stdio child (upstream.stdio)")
        self._waiting += 1
        try:
            return await asyncio.wait_for(self._pick_for(caller, message), self._wait_s)
        except TimeoutError:
            raise ChildUnavailable(
                f"every stdio child ({len(self.channels)}, upstream.stdio.max_children) serves another caller's "
                f"calls, and none was free within {self._wait_s:g} s (upstream.stdio.start_timeout_s)"
            ) from None
        finally:
            self._waiting -= 1

    async def _pick_for(self, caller: str, message: dict[str, Any]) -> tuple[StdioChannel, bool]:
        """A child of the caller's own, taken for it when it has none that fits, else waited for."""
        while True:
            seen = self._changes  # before looking: whatever changes from here on ends the wait below
            mine = self._of(caller)
            if mine:
                found = self._fitting(message, mine)
                if found is not None:
                    return found, self.exclusive and may_ask(message.get("method"))
            taken = await self._take_for(caller)
            if taken is not None:
                continue  # it is the caller's now: chosen by the same rules as its others
            # Its own round nobody retried first; another caller's only when this one has no child at all (shared,
            # it can share one of its own instead).
            if not self._end_a_round(caller, anyone=not mine or self.exclusive) and mine and not self.exclusive:
                return self._least_busy(mine), False  # shared, and nothing to take: as before
            async with self._freed:  # a call ends (a round ended here, too), a child is added or goes idle
                await self._freed.wait_for(lambda seen=seen: self._changes != seen)  # type: ignore[misc]

    async def _pick_among(self, message: dict[str, Any]) -> tuple[StdioChannel, bool]:
        """Children shared by every caller (or the proxy's own requests): the dispatch rules over all of them."""
        if not may_ask(message.get("method")):
            return self._least_busy(), False
        if not self.exclusive:
            calm = lambda: self._without_questions(self.channels)  # noqa: E731
            channel = calm() or await self._grow(found=calm)
            return channel or self._least_busy(), False
        if self._waiting >= self._max_waiting:
            raise ChildUnavailable(f"{self._waiting} calls wait for a free stdio child (upstream.stdio.children)")
        self._waiting += 1
        try:
            free = lambda: self._free(self.channels)  # noqa: E731
            if free() is None:
                await self._grow(found=free)
            async with self._freed:
                await self._freed.wait_for(lambda: free() is not None)
                channel = free()
                assert channel is not None
                channel.reserved += 1  # taken before the request is written, so no second call picks it meanwhile
                return channel, True
        finally:
            self._waiting -= 1

    def _fitting(self, message: dict[str, Any], among: list[StdioChannel]) -> StdioChannel | None:
        """The child of `among` the dispatch rules give this request, without waiting (reserved for it under
        exclusive dispatch); None when none fits."""
        if not may_ask(message.get("method")):
            return self._least_busy(among)
        if not self.exclusive:
            return self._without_questions(among)
        channel = self._free(among)
        if channel is not None:
            channel.reserved += 1  # taken before the request is written, so no second call picks it meanwhile
        return channel

    async def _take_for(self, caller: str) -> StdioChannel | None:
        """Give the caller another child: one nobody has, a new one (up to max_children), or the idle child of
        another caller, restarted so that nothing of that caller's reaches this one. None when all are busy."""
        unowned = self._unowned(caller)
        if unowned:
            return unowned[0]
        had = len(self._of(caller))
        # (Another of the caller's calls may have grown the pool for it while this one waited to: that child.)
        channel = await self._grow(caller, found=lambda: next(iter(self._of(caller)[had:]), None))
        if channel is not None:
            return channel
        idle = [channel for channel in self.channels if channel.owner != caller and channel.idle]
        if not idle:
            return None
        channel = min(idle, key=lambda channel: channel.last_used)
        channel.owner = caller
        log.info("stdio_child_reassigned", upstream=self.name, child=channel.index)
        # Taken out of service now, before any request of the new caller's can reach the old run (or another caller
        # take it: a child not running is not idle); stopped in the background, whatever becomes of this request.
        # The caller's requests wait for the new run as for any restart (start_timeout_s).
        stopping = channel.supervisor.recycle()
        if stopping is not None:
            restart = asyncio.ensure_future(stopping)
            self._restarts.add(restart)
            restart.add_done_callback(self._restarts.discard)
        return channel

    def _end_a_round(self, caller: str, *, anyone: bool) -> bool:
        """Every child is held: end the oldest MRTR round still waiting for its client's retry, the caller's own
        first, then (`anyone`) another caller's: MRTR lets a client read a round and never retry, and such a round
        must not hold every copy of the server."""
        if any(end(caller) for end in self.round_enders):
            return True
        return anyone and any(end(None) for end in self.round_enders)

    def _unowned(self, caller: str) -> list[StdioChannel]:
        """A child nobody has had yet, now the caller's (as a list of its children); [] when there is none."""
        for channel in self.channels:
            if channel.owner is None:
                channel.owner = caller
                return [channel]
        return []

    def _of(self, caller: str) -> list[StdioChannel]:
        return [channel for channel in self.channels if channel.owner == caller]

    async def _grow(
        self, owner: str | None = None, found: Callable[[], StdioChannel | None] = lambda: None
    ) -> StdioChannel | None:
        """Start one more child (for `owner`), unless `found` finds one after all (another call grew the pool
        meanwhile) or the pool is at max_children; the new child, or None."""
        async with self._growing:
            channel = found()
            if channel is not None or len(self.channels) >= self.max_children or self._stopping:
                return channel
            channel = self._channel(len(self.channels))
            channel.owner = owner
            try:
                await channel.start()
            except OSError as exc:
                log.warning("stdio_child_not_added", upstream=self.name, reason=str(exc))
                return None
            self.channels.append(channel)
            log.info("stdio_child_added", upstream=self.name, children=len(self.channels), max=self.max_children)
            self._wake()
            return channel

    @staticmethod
    def _without_questions(among: list[StdioChannel]) -> StdioChannel | None:
        """The least busy child with no question of its own open (a running one first: one that is restarting
        has none open either, and is no reason to start another), if any."""
        calm = [channel for channel in among if channel.open_questions == 0]
        running = [channel for channel in calm if channel.supervisor.child is not None]
        return min(running or calm, key=lambda channel: channel.in_flight) if calm else None

    @staticmethod
    def _free(among: list[StdioChannel]) -> StdioChannel | None:
        free = [channel for channel in among if channel.asking + channel.reserved == 0]
        running = [channel for channel in free if channel.supervisor.child is not None]
        return (running or free or [None])[0]

    def _least_busy(self, among: list[StdioChannel] | None = None) -> StdioChannel:
        among = among or self.channels
        running = [channel for channel in among if channel.supervisor.child is not None] or among
        return min(running, key=lambda channel: channel.in_flight)

    def _forgotten(self, exchange: Exchange) -> None:
        if (exchange.may_ask and self.exclusive) or self._waiting:
            self._wake()

    def _wake(self) -> None:
        self._changes += 1

        async def wake() -> None:
            async with self._freed:
                self._freed.notify_all()

        asyncio.ensure_future(wake())


def _binding(route: CallRoute | None, message: dict[str, Any]) -> str:
    """What a wrapped requestState is bound to: the caller, the method, and the tool, prompt or resource. Not an
    anonymous caller's address: a retry forwarded from another replica arrives from that replica's."""
    params = params_of(message)
    caller = route.caller if route is not None and not route.caller.startswith(ANONYMOUS) else ""
    return f"{caller}|{message.get('method')}|{params.get('name', params.get('uri'))}"
