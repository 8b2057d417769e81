"""Task creations first: the background work of tasks gives way to the creations being answered.

Every creation starts its call in the background, on the same event loop that answers the next creation. asyncio
runs what is ready in the order it became ready, so a creation that arrives while earlier tasks start their
upstream calls and settle their outcomes waits behind all of that work, and its answer, the one thing the client
waits for, comes late. Here the lane counts a creation from the moment its body is read until it is answered, and a
task's attempt (before its upstream call is sent) and its settlement (before the outcome is written) wait while any
is counted: until as many creations have been answered as were counted when it began to wait, and never longer than
MAX_WAIT_S, so no stream of creations holds a task back for long.

Only creations that answer from the proxy's own work are counted: not one with a sync window, nor an MRTR retry
that resumes a call parked in its window (such a creation waits for the call itself).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..config import ToolRule

MAX_WAIT_S = 0.005
"""The longest a task's step waits for creations: a few of them, and far below any poll interval."""


class Precedence:
    """The creations being answered on this event loop, and the task steps waiting for them."""

    __slots__ = ("pending", "_answered", "_waiting", "_order", "_release")

    def __init__(self) -> None:
        self.pending = 0
        """Creations read and not yet answered: while it is zero, `give_way` is not needed (and not awaited)."""
        self._answered = 0
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        """(answered count it waits for, arrival order, future): a heap, as the counts come in any order."""
        self._order = itertools.count()
        self._release: asyncio.TimerHandle | None = None

    @staticmethod
    def counts(rule: ToolRule, params: dict[str, Any]) -> bool:
        """Whether a creation is counted: not under a rule with a sync window, nor an MRTR retry (which resumes a
        call parked in its window): both wait for their own call."""
        return rule.sync_window_ms == 0 and params.get("requestState") is None

    def begin(self) -> None:
        """A creation was read; it is answered next."""
        self.pending += 1

    def end(self, _: Any = None) -> None:
        """A creation was answered, or gave up (also a done callback: the argument is the answer's task)."""
        self.pending -= 1
        self._answered += 1
        waiting = self._waiting
        while waiting and waiting[0][0] <= self._answered:
            _wake(heapq.heappop(waiting)[2])
        if not waiting and self._release is not None:
            self._release.cancel()
            self._release = None

    async def give_way(self) -> None:
        """Wait until the creations pending now are answered, or MAX_WAIT_S."""
        if not self.pending:
            return
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        heapq.heappush(self._waiting, (self._answered + self.pending, next(self._order), waiter))
        if self._release is None:
            self._release = loop.call_later(MAX_WAIT_S, self._release_all)
        await waiter

    def _release_all(self) -> None:
        self._release = None
        waiting, self._waiting = self._waiting, []
        for _, _, waiter in waiting:
            _wake(waiter)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():  # a waiter cancelled (its task stopped) is skipped
        waiter.set_result(None)
