"""Time limits for thousands of working calls at the cost of a set entry each.

`asyncio.timeout` holds a Timeout object, a timer handle, a bound method and a copied context per call: about 740
bytes for each working task, measured with tracemalloc at 2,000 working tasks. Here the limits that end in the
same tenth of a second share one timer; each limit is a small object in that tenth's set. The semantics are
asyncio.timeout's: the expired task is cancelled, and the CancelledError turns into TimeoutError at the limit's
exit unless something else cancelled the task too (counted from the limit's entry, as Python 3.12 does). A limit
ends up to one tenth of a second late; an infinite one never ends.
"""

from __future__ import annotations

import asyncio
import math
from types import TracebackType

_TICKS_PER_S = 10


class Deadlines:
    """The limits of one event loop, grouped by the tenth of a second they end in."""

    __slots__ = ("_buckets", "_timers")

    def __init__(self) -> None:
        self._buckets: dict[int, set[Limit]] = {}
        self._timers: dict[int, asyncio.TimerHandle] = {}

    def limit(self, seconds: float) -> Limit:
        """A limit of `seconds` on the current task, from now, for a `with` block."""
        return Limit(self, seconds)

    def _add(self, limit: Limit, when: float) -> int | None:
        if not math.isfinite(when):
            return None  # no limit (timeout_s: .inf)
        tick = math.ceil(when * _TICKS_PER_S)
        bucket = self._buckets.get(tick)
        if bucket is None:
            bucket = self._buckets[tick] = set()
            self._timers[tick] = asyncio.get_running_loop().call_at(tick / _TICKS_PER_S, self._expire, tick)
        bucket.add(limit)
        return tick

    def _discard(self, limit: Limit, tick: int | None) -> None:
        if tick is None:
            return
        bucket = self._buckets.get(tick)
        if bucket is not None:
            bucket.discard(limit)
            if not bucket:
                # No limit ends in that tenth any more: neither its set (however large it grew) nor its timer is
                # kept until then, which is the calls' whole timeout_s (an hour by default) after they started.
                del self._buckets[tick]
                self._timers.pop(tick).cancel()

    def _expire(self, tick: int) -> None:
        self._timers.pop(tick, None)
        for limit in self._buckets.pop(tick, ()):
            limit.expire()


class Limit:
    __slots__ = ("_deadlines", "_seconds", "_task", "_tick", "_cancelling", "_expired")

    def __init__(self, deadlines: Deadlines, seconds: float) -> None:
        self._deadlines = deadlines
        self._seconds = seconds
        self._expired = False

    def __enter__(self) -> Limit:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a deadline limits a task: none is running")
        self._task = task
        self._cancelling = task.cancelling()
        self._tick = self._deadlines._add(self, asyncio.get_running_loop().time() + self._seconds)
        return self

    def expire(self) -> None:
        self._expired = True
        self._task.cancel()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        task = self._task
        del self._task  # nothing kept alive by a finished limit
        if not self._expired:
            self._deadlines._discard(self, self._tick)
        elif task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc
