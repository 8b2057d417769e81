"""Rate limits on the requests to the MCP endpoint (limits.rates), checked at the front door for both readers.

Each limit is a GCRA (the generic cell rate algorithm: a sustained rate and a burst, kept as one timestamp per
key). With the Redis store every replica counts against the same key, on Redis's clock (store.rate, one script
call per limit that applies); with the memory store, or while Redis does not answer, each replica counts alone
(logged, and counted in mcp_tasks_proxy_rate_limit_local_total; after a failure, for 5 s without asking Redis). A
request past a limit gets HTTP 429 with Retry-After, and -32603 naming the limit and the wait."""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import structlog
from cachetools import TLRUCache

from ..clients.envelope import tool_name
from ..config import LimitsConfig, RateLimit
from ..jsonrpc import INTERNAL_ERROR, JsonRpcError
from ..metrics import Metrics
from ..store.base import StoreUnavailable, TaskStore

log = structlog.get_logger(__name__)

_LOCAL_KEYS = 100_000
"""Keys one replica counts alone at most (the least recently used go first: their next request starts afresh)."""
_LONG_NAME = 128
"""A tool name longer than this is counted under its hash: the key stays short whatever a client sends."""
_AHEAD_S = 0.05
"""With Redis, a replica under load counts a limit's requests ahead, up to this long's worth of its rate (never more
than its burst), and admits them without asking again: one script call for many requests. What it counted and did
not use within this time is given back with its next call for the key, if that comes within twice this time: what is
admitted over any period stays within the limit over that period and this long more."""


class _Ahead:
    """Requests of one key a replica counted in Redis ahead of their coming: `left` of `size`, until `until`."""

    __slots__ = ("left", "size", "until")

    def __init__(self, left: int, size: int, until: float) -> None:
        self.left = left
        self.size = size
        self.until = until


class CountingAlone:
    """After Redis failed to answer, a replica counts its limits alone for 5 s without asking it again (a Redis that
    stalls must not hold every request for its timeout once per limit), said in the log every 30 s at most."""

    _FOR_S = 5.0
    _LOG_EVERY_S = 30.0

    def __init__(self, timer: Callable[[], float], event: str) -> None:
        self._timer = timer
        self._event = event
        self._until = -1.0
        self._logged = -self._LOG_EVERY_S

    @property
    def now(self) -> bool:
        return self._timer() < self._until

    def failed(self, exc: StoreUnavailable) -> None:
        now = self._timer()
        self._until = now + self._FOR_S
        if now - self._logged >= self._LOG_EVERY_S:
            self._logged = now
            log.warning(self._event, reason=str(exc), meaning="each replica counts alone meanwhile")


class RateLimited(JsonRpcError):
    """A request past a rate limit: HTTP 429 with Retry-After (retry_after_s)."""

    def __init__(self, limit: str, wait_s: float, why: str | None = None) -> None:
        wait_ms = max(1, math.ceil(wait_s * 1000))
        which = "limits.rates" if why is None else f"limits.rates: {why}"
        super().__init__(
            INTERNAL_ERROR,
            f"Rate limited: past the limit {limit!r} ({which}); retry in {wait_ms} ms",
            {"limit": limit, "retryAfterMs": wait_ms},
            http_status=429,
        )
        self.retry_after_s = wait_s


class Rates:
    def __init__(
        self,
        limits: Callable[[], LimitsConfig],
        store: TaskStore,
        metrics: Metrics,
        *,
        timer: Callable[[], float] = time.monotonic,
    ) -> None:
        self._limits = limits
        self._store = store
        self._metrics = metrics
        self._timer = timer
        self._local: TLRUCache[str, float] = TLRUCache(_LOCAL_KEYS, ttu=lambda _key, tat, _now: tat, timer=timer)
        """Per key, the theoretical arrival time of its next request (on `timer`), kept until then."""
        self._ahead: TLRUCache[str, _Ahead] = TLRUCache(
            _LOCAL_KEYS, ttu=lambda _key, ahead, _now: ahead.until + _AHEAD_S, timer=timer
        )
        """Per key, the requests counted in Redis ahead (kept a while after, for how many the next count takes)."""
        self._alone = CountingAlone(timer, "rate_limits_local")
        for rate in limits().rates:  # each limit a series from the start, for rate() and alerts
            metrics.rate_limited.labels(rate.label)

    @property
    def configured(self) -> bool:
        return self._limits().rated

    async def check(self, messages: Any, caller: str) -> None:
        """Count the request's JSON-RPC messages (a message, or a batch's) against every limit that applies;
        RateLimited for the first one past its limit (those already counted stay counted, as at any gateway)."""
        for rate, index, key in limited_keys(self._limits().rates, messages, caller):
            if rate.requests_per_s is None:
                continue
            wait_s = await self._count(rate, f"{index}:{key}")
            if wait_s > 0:
                self._metrics.rate_limited.labels(rate.label).inc()
                raise RateLimited(rate.label, wait_s)

    async def _count(self, rate: RateLimit, key: str) -> float:
        assert rate.requests_per_s is not None
        interval_s = 1 / rate.requests_per_s
        tolerance_s = interval_s * (rate.allowed_burst - 1)
        now = self._timer()
        if self._store.shared and not self._alone.now:
            ahead = self._ahead.get(key)
            if ahead is not None and ahead.left and now < ahead.until:
                ahead.left -= 1
                return 0.0
            count = _ahead_of(rate, ahead, now)
            unused = 0
            if ahead is not None and ahead.left:  # counted before, and its time is up: given back in this call
                unused, ahead.left = ahead.left, 0
            interval_us, tolerance_us = math.ceil(interval_s * 1e6), math.floor(tolerance_s * 1e6)
            try:
                counted = await self._store.rate(key, interval_us, tolerance_us, count, unused)
                if counted is not None:
                    if counted < 0:
                        return -counted / 1e6
                    self._keep_ahead(key, counted)
                    return 0.0
            except StoreUnavailable as exc:
                self._alone.failed(exc)
        if self._store.shared:
            self._metrics.rate_limit_local.labels(rate.label).inc()
        return self._count_here(key, interval_s, tolerance_s)

    def _keep_ahead(self, key: str, counted: int) -> None:
        now = self._timer()
        kept = self._ahead.get(key)
        if kept is not None and kept.left and now < kept.until:  # counted by a request that asked meanwhile
            kept.left += counted - 1
            kept.size += counted
        else:
            self._ahead[key] = _Ahead(counted - 1, counted, now + _AHEAD_S)

    def _count_here(self, key: str, interval_s: float, tolerance_s: float) -> float:
        now = self._timer()
        tat = max(self._local.get(key, now), now)
        wait_s = tat - now - tolerance_s
        if wait_s > 0:
            return wait_s
        self._local[key] = tat + interval_s
        return 0.0


def _ahead_of(rate: RateLimit, last: _Ahead | None, now: float) -> int:
    """How many requests to count in Redis for the one at hand: twice the last count when all of it was used in
    time, else as many as were used; 1 for a key not seen lately. Never past _AHEAD_S of the rate, nor the burst."""
    assert rate.requests_per_s is not None
    most = min(rate.allowed_burst, math.floor(rate.requests_per_s * _AHEAD_S))
    if last is None or most <= 1:
        return 1
    if last.left == 0 and now < last.until:
        return min(most, last.size * 2)
    return max(1, min(most, last.size - last.left))


def limited_keys(rates: list[RateLimit], messages: Any, caller: str) -> Iterator[tuple[RateLimit, int, str]]:
    """Each limit a message counts against, with its index and its key: what the limit's `per` names for it (for
    a rate and for a concurrency alike)."""
    for message in messages if isinstance(messages, list) else [messages]:
        tool = tool_name(message)
        for index, rate in enumerate(rates):
            if (rate.match is not None or rate.per in ("tool", "caller+tool")) and tool is None:
                continue
            if rate.match is not None and not rate.matches(tool):  # type: ignore[arg-type]
                continue
            if rate.per == "caller":
                yield rate, index, caller
            elif rate.per == "tool":
                yield rate, index, _short(tool)  # type: ignore[arg-type]
            elif rate.per == "caller+tool":
                yield rate, index, f"{caller}|{_short(tool)}"  # type: ignore[arg-type]
            else:
                yield rate, index, "upstream"


def _short(name: str) -> str:
    if len(name) <= _LONG_NAME and name.isprintable():
        return name
    return "#" + hashlib.sha256(name.encode("utf-8", "surrogateescape")).hexdigest()
