"""Concurrency limits (limits.rates' `concurrency`): how many tools/call may run at once, per caller, tool, both, or
the upstream, checked at the front door for both readers (boundary.apply_limits).

A call answered directly takes its slots as it comes in (a Claim) and gives them back once answered; a call that goes
on in the background (a task, a durable or kept-alive call) takes them as it starts (Claim.admit) and gives them back
when it ends. With the Redis store a slot is a lease in Redis, renewed by the replica that holds it, given back when
it stops and lapsing when it is lost; with the memory store, or for 5 s after Redis failed to answer, each replica
counts alone."""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any

import structlog

from ..clients.envelope import tool_name
from ..config import LimitsConfig, RateLimit
from ..metrics import Metrics
from ..store.base import StoreUnavailable, TaskStore
from .rates import CountingAlone, RateLimited, limited_keys

log = structlog.get_logger(__name__)

LEASE_S = 30.0
"""A slot's lease in Redis: a lost replica's slots are free again after it."""
_RENEW_S = 10.0
_POLL_S = (0.05, 1.0)
"""A queued request asks Redis again after the first wait, doubling up to the second: another replica frees its
slots without telling."""
_RELEASE_AFTER_S = 0.005
"""Slots given back in Redis wait this long for the next take on this replica, which carries them in its script
call (one call per request under load, not two); alone, they go in a call of their own."""
_REFUSED_WAIT_S = 1.0
"""The Retry-After of a refusal: when a call ends is not known."""


class Claim:
    """The slots one request (and the background call it may become) needs: per limit and key, how many."""

    __slots__ = ("_owner", "wanted", "lease", "held", "shared", "passed", "limit")

    def __init__(self, owner: Concurrency, wanted: dict[str, tuple[RateLimit, int]], lease: str) -> None:
        self._owner = owner
        self.wanted = wanted
        """By the limit's index and key (`index:key`), the limit and how many slots."""
        self.lease = lease
        self.held = False
        self.shared = False
        """Held in Redis (else counted on this replica)."""
        self.passed = False
        """A background call holds it from now on, and gives it back when it ends; its request does not."""
        self.limit: RateLimit | None = None
        """The limit that had no free slot when last asked."""

    @property
    def full(self) -> str | None:
        return None if self.limit is None else self.limit.label

    async def take(self, *, force: bool = False) -> RateLimit | None:
        """Take every slot, or none: None when taken, else a limit that has too few free. `force`: taken whatever
        the counts (a call taken over from a lost replica, admitted there)."""
        self.limit = await self._owner.take(self, force=force)
        return self.limit

    async def admit(self) -> bool:
        """A new background call's slots, taken as it starts: True when held, False when its limit queues (the
        call waits for them, `wait`); RateLimited when a limit that refuses is full."""
        full = await self.take()
        if full is not None and full.on_limit == "refuse":
            raise self._owner.refused(full)
        return full is None

    async def wait(self, timeout_s: float | None, *, patient: bool = False) -> None:
        """Wait until every slot is free and take them; RateLimited past `timeout_s`, or as soon as a limit that
        refuses is full unless `patient` (a background call admitted before: it waits whatever the limit says)."""
        await self._owner.wait(self, timeout_s, patient=patient)

    def release(self) -> None:
        """Give the slots back (nothing when none is held); Redis hears of it in the background."""
        if self.held:
            self.held = False
            self._owner.release(self)


class Concurrency:
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
        self._name = secrets.token_hex(6)
        """This replica's leases' prefix."""
        self._numbers = itertools.count(1)
        self._counts: dict[str, int] = {}
        """Slots held on this replica (not in Redis), by `index:key`; no entry for a count of 0."""
        self._shared_counts: dict[str, int] = {}
        """Slots this replica holds in Redis, by `index:key`: counted too while it counts alone (Redis failed)."""
        self._freed: asyncio.Event | None = None
        """Set when slots held here are given back: the requests queued here try again, in the order they came."""
        self._renewed: set[Claim] = set()
        """The claims held in Redis, whose leases are renewed."""
        self._renewer: asyncio.Task[None] | None = None
        self._pending: set[asyncio.Task[Any]] = set()
        self._releasing: list[tuple[str, str]] = []
        """Leases given back here, not yet in Redis: the next take carries them, or `_flush` after _RELEASE_AFTER_S."""
        self._flushing: asyncio.TimerHandle | None = None
        self._alone = CountingAlone(timer, "concurrency_limits_local")

    @property
    def configured(self) -> bool:
        return self._limits().concurrent

    def claim(self, messages: Any, caller: str) -> Claim | None:
        """The slots the request's calls need (its tools/call, or a batch's), or None when no limit applies. Only
        calls count: polling and streams would otherwise wait behind the very calls they follow."""
        calls = [message for message in (messages if isinstance(messages, list) else [messages]) if tool_name(message)]
        if not calls:
            return None
        wanted: dict[str, tuple[RateLimit, int]] = {}
        for rate, index, key in limited_keys(self._limits().rates, calls, caller):
            if rate.concurrency is not None:
                name = f"{index}:{key}"
                wanted[name] = (rate, wanted[name][1] + 1 if name in wanted else 1)
        return Claim(self, wanted, f"{self._name}:{next(self._numbers)}") if wanted else None

    def claim_for_call(self, tool: str, caller: str) -> Claim | None:
        """The slots a tools/call of `tool` by `caller` needs (a call taken over from a lost replica)."""
        return self.claim({"method": "tools/call", "params": {"name": tool}}, caller)

    async def enter(self, claim: Claim) -> None:
        """A request's claim at the front door: taken, or refused (RateLimited), or waited for (on_limit: queue,
        up to its queue_timeout_s)."""
        full = await claim.take()
        if full is None:
            return
        if full.on_limit == "refuse":
            raise self.refused(full)
        await claim.wait(full.queue_timeout_s)

    @staticmethod
    async def hold(claim: Claim | None) -> None:
        """A call the front door let by to become a background call (which takes its slots as it starts: `admit`)
        is answered directly after all: its slots are taken, refused or waited for here, as `enter` does."""
        if claim is not None and not claim.held and not claim.passed:
            await claim._owner.enter(claim)

    async def take(self, claim: Claim, *, force: bool = False) -> RateLimit | None:
        if claim.held:
            return None
        if self._store.shared and not self._alone.now:
            names = list(claim.wanted)
            wanted = [(rate.concurrency or 0, count) for rate, count in claim.wanted.values()]
            releasing = self._take_releases()
            try:
                full = await self._store.take_slots(
                    names, wanted, claim.lease, int(LEASE_S * 1e6), force=force, releasing=releasing
                )
            except StoreUnavailable as exc:  # (should the script still run, its lease lapses: counted too long)
                self._alone.failed(exc)
                self._release_in_redis(releasing)  # asked again: they lapse if Redis does not answer
            except asyncio.CancelledError:  # the client left while Redis took the slots
                self._release_in_redis([*releasing, *_members(claim)])
                raise
            else:
                if full is not None:
                    if full:
                        return claim.wanted[names[full - 1]][0]
                    claim.held = claim.shared = True
                    _add(self._shared_counts, claim, 1)
                    self._renew(claim)
                    return None
        return self._take_here(claim, force=force)

    def _take_here(self, claim: Claim, *, force: bool) -> RateLimit | None:
        if self._store.shared:
            for rate, _ in claim.wanted.values():
                self._metrics.rate_limit_local.labels(rate.label).inc()
        if not force:
            for name, (rate, count) in claim.wanted.items():
                held = self._counts.get(name, 0) + self._shared_counts.get(name, 0)
                if held + count > (rate.concurrency or 0):
                    return rate
        _add(self._counts, claim, 1)
        claim.held = True
        claim.shared = False
        return None

    async def wait(self, claim: Claim, timeout_s: float | None, *, patient: bool = False) -> None:
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        poll_s = _POLL_S[0]
        while True:
            full = await claim.take()  # (the claim's: it notes the full limit)
            if full is None:
                return
            if full.on_limit == "refuse" and not patient:
                raise self.refused(full)
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                raise self.refused(full, waited=True)
            if self._freed is None:
                self._freed = asyncio.Event()
            freed = self._freed
            pause = poll_s if self._store.shared else None  # another replica frees its slots without telling
            pause = left if pause is None else pause if left is None else min(pause, left)
            try:
                await asyncio.wait_for(freed.wait(), pause)
            except TimeoutError:
                poll_s = min(poll_s * 2, _POLL_S[1])

    def release(self, claim: Claim) -> None:
        if claim.shared:
            self._renewed.discard(claim)
            _add(self._shared_counts, claim, -1)
            self._releasing.extend(_members(claim))
            if self._flushing is None:
                self._flushing = asyncio.get_running_loop().call_later(_RELEASE_AFTER_S, self._flush)
        else:
            _add(self._counts, claim, -1)
        if self._freed is not None:  # the requests queued here try again
            self._freed.set()
            self._freed = None

    async def aclose(self) -> None:
        """Stop renewing, and give back in Redis what this replica still holds (calls stopped at shutdown) and what
        it was giving back, within a second: a rolling deploy must not leave the limits full of calls that no
        longer run (what is not given back lapses with its lease)."""
        if self._renewer is not None:
            self._renewer.cancel()
        held = [*self._take_releases(), *(member for claim in self._renewed for member in _members(claim))]
        self._renewed.clear()
        self._release_in_redis(held)
        if self._pending:
            await asyncio.wait(list(self._pending), timeout=1.0)
        for task in list(self._pending):
            task.cancel()

    def refused(self, rate: RateLimit, *, waited: bool = False) -> RateLimited:
        self._metrics.rate_limited.labels(rate.label).inc()
        why = f"queued {rate.queue_timeout_s:g} s without a free slot" if waited else "no free slot"
        return RateLimited(rate.label, _REFUSED_WAIT_S, f"{rate.concurrency} at once, {why}")

    def _take_releases(self) -> list[tuple[str, str]]:
        """The leases given back here and not yet in Redis, now this replica's to send."""
        if self._flushing is not None:
            self._flushing.cancel()
            self._flushing = None
        releasing, self._releasing = self._releasing, []
        return releasing

    def _flush(self) -> None:
        self._flushing = None
        self._release_in_redis(self._take_releases())

    def _release_in_redis(self, held: list[tuple[str, str]]) -> None:
        if held:
            self._background(self._keep(held, 0))

    def _renew(self, claim: Claim) -> None:
        self._renewed.add(claim)
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.get_running_loop().create_task(self._renewing(), name="concurrency-renewal")

    async def _renewing(self) -> None:
        while self._renewed:
            await asyncio.sleep(_RENEW_S)
            held = [member for claim in list(self._renewed) for member in _members(claim)]
            if held:
                found = await self._keep(held, int(LEASE_S * 1e6))
                if found is not None and found < len(held):  # (a Redis restarted empty): written again
                    log.warning("concurrency_leases_restored", held=len(held), found=found)

    async def _keep(self, held: list[tuple[str, str]], life_us: int) -> int | None:
        try:
            return await self._store.keep_slots(held, life_us)
        except StoreUnavailable as exc:
            self._alone.failed(exc)
            return None  # a lease not renewed or released lapses by itself

    def _background(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)


def _members(claim: Claim) -> Iterator[tuple[str, str]]:
    """The claim's leases in Redis: (limit key, member) for each slot it takes."""
    for name, (_, count) in claim.wanted.items():
        for n in range(1, count + 1):
            yield name, f"{claim.lease}:{n}"


def _add(counts: dict[str, int], claim: Claim, sign: int) -> None:
    """Count the claim's slots in (sign 1) or out (-1); no entry is kept for a count of 0."""
    for name, (_, count) in claim.wanted.items():
        left = counts.get(name, 0) + sign * count
        if left > 0:
            counts[name] = left
        else:
            counts.pop(name, None)
