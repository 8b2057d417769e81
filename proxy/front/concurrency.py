"""Concurrency limits (limits.rates' `concurrency`): how many requests and background calls may run at once, per
caller, tool, both, or the upstream, checked at the front door (the lane leaves a request one applies to the
application's handler).

A request takes its slots as it comes in (a Claim) and gives them back once answered; a call that goes on in the
background (a task, a durable or kept-alive call) takes its request's claim over and gives it back when it ends.
With the Redis store a slot is a lease in Redis, renewed by the replica that holds it and lapsing when that replica
is lost; with the memory store, or for 5 s after Redis failed to answer, each replica counts alone."""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from collections.abc import Callable
from typing import Any

import structlog

from ..clients.envelope import params_of, tool_name
from ..config import LimitsConfig, RateLimit
from ..metrics import Metrics
from ..store.base import StoreUnavailable, TaskStore
from .rates import RateLimited, limited_keys

log = structlog.get_logger(__name__)

LEASE_S = 30.0
"""A slot's lease in Redis: a lost replica's slots are free again after it."""
_RENEW_S = 10.0
_POLL_S = (0.05, 1.0)
"""A queued request asks Redis again after the first wait, doubling up to the second: another replica frees its
slots without telling."""
_REFUSED_WAIT_S = 1.0
"""The Retry-After of a refusal: when a call ends is not known."""
_LOCAL_AFTER_FAILURE_S = 5.0
_FALLBACK_LOG_S = 30.0


class Claim:
    """The slots one request (and the background call it may become) needs: per limit and key, how many."""

    __slots__ = ("_owner", "wanted", "lease", "continues", "held", "shared", "passed", "limit")

    def __init__(
        self, owner: Concurrency, wanted: dict[str, tuple[RateLimit, int]], lease: str, *, continues: bool = False
    ) -> None:
        self._owner = owner
        self.continues = continues
        """The retry of an input round (requestState): it continues a call admitted before, so it is never refused
        nor queued (a slot is taken whatever the counts, for a call that goes on from it)."""
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

    async def wait(self, timeout_s: float | None) -> None:
        """Wait until every slot is free and take them; RateLimited past `timeout_s`, or as soon as a limit that
        refuses is full."""
        await self._owner.wait(self, timeout_s)

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
        self._timer = timer
        self._name = secrets.token_hex(6)
        """This replica's leases' prefix."""
        self._numbers = itertools.count(1)
        self._counts: dict[str, int] = {}
        """Slots held on this replica (not in Redis), by `index:key`; no entry for a count of 0."""
        self._freed: asyncio.Event | None = None
        """Set when slots held here are given back: the requests queued here try again, in the order they came."""
        self._renewed: set[Claim] = set()
        """The claims held in Redis, whose leases are renewed."""
        self._renewer: asyncio.Task[None] | None = None
        self._pending: set[asyncio.Task[Any]] = set()
        self._local_until = -1.0
        self._fallback_logged = -_FALLBACK_LOG_S

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
        if not wanted:
            return None
        continues = len(calls) == 1 and params_of(calls[0]).get("requestState") is not None
        return Claim(self, wanted, f"{self._name}:{next(self._numbers)}", continues=continues)

    def claim_for_call(self, tool: str, caller: str) -> Claim | None:
        """The slots a tools/call of `tool` by `caller` needs (a call taken over from a lost replica)."""
        return self.claim({"method": "tools/call", "params": {"name": tool}}, caller)

    async def enter(self, claim: Claim, *, background: bool) -> None:
        """A request's claim at the front door: taken, or refused (RateLimited), or waited for (on_limit: queue).
        `background`: the request may become a background call, which waits as a queued task instead (`hold`
        waits here, should it not)."""
        full = await claim.take(force=claim.continues)
        if full is None:
            return
        if full.on_limit == "refuse":
            raise self._refused(full)
        if not background:
            await claim.wait(full.queue_timeout_s)

    @staticmethod
    async def hold(claim: Claim | None) -> None:
        """A request that `enter` let by unheld, to become a background call, is answered directly after all: it
        waits for its slots here."""
        if claim is not None and not claim.held and not claim.passed:
            await claim.wait(claim.limit.queue_timeout_s if claim.limit is not None else None)

    async def take(self, claim: Claim, *, force: bool = False) -> RateLimit | None:
        if claim.held:
            return None
        if self._store.shared and self._timer() >= self._local_until:
            names = list(claim.wanted)
            wanted = [(rate.concurrency or 0, count) for rate, count in claim.wanted.values()]
            try:
                full = await self._store.take_slots(names, wanted, claim.lease, int(LEASE_S * 1e6), force=force)
            except StoreUnavailable as exc:
                self._fall_back(exc)
            else:
                if full is not None:
                    if full:
                        return claim.wanted[names[full - 1]][0]
                    claim.held = claim.shared = True
                    self._renew(claim)
                    return None
        return self._take_here(claim, force=force)

    def _take_here(self, claim: Claim, *, force: bool) -> RateLimit | None:
        if self._store.shared:
            for rate, _ in claim.wanted.values():
                self._metrics.rate_limit_local.labels(rate.label).inc()
        if not force:
            for name, (rate, count) in claim.wanted.items():
                if self._counts.get(name, 0) + count > (rate.concurrency or 0):
                    return rate
        for name, (_, count) in claim.wanted.items():
            self._counts[name] = self._counts.get(name, 0) + count
        claim.held = True
        claim.shared = False
        return None

    async def wait(self, claim: Claim, timeout_s: float | None) -> None:
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        poll_s = _POLL_S[0]
        while True:
            full = await claim.take()  # (the claim's: it notes the full limit)
            if full is None:
                return
            if full.on_limit == "refuse":
                raise self._refused(full)
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                raise self._refused(full, waited=True)
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
            held = [
                (name, f"{claim.lease}:{n}") for name, (_, count) in claim.wanted.items() for n in range(1, count + 1)
            ]
            self._background(self._keep(held, 0))
        else:
            for name, (_, count) in claim.wanted.items():
                left = self._counts.get(name, 0) - count
                if left > 0:
                    self._counts[name] = left
                else:
                    self._counts.pop(name, None)
        if self._freed is not None:  # the requests queued here try again
            self._freed.set()
            self._freed = None

    async def aclose(self) -> None:
        """Stop renewing (the leases lapse) and let go of the releases under way."""
        if self._renewer is not None:
            self._renewer.cancel()
        for task in list(self._pending):
            task.cancel()

    def _refused(self, rate: RateLimit, *, waited: bool = False) -> RateLimited:
        self._metrics.rate_limited.labels(rate.label).inc()
        why = f"queued {rate.queue_timeout_s:g} s without a free slot" if waited else "no free slot"
        return RateLimited(rate.label, _REFUSED_WAIT_S, f"{rate.concurrency} at once, {why}")

    def _renew(self, claim: Claim) -> None:
        self._renewed.add(claim)
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.get_running_loop().create_task(self._renewing(), name="concurrency-renewal")

    async def _renewing(self) -> None:
        while self._renewed:
            await asyncio.sleep(_RENEW_S)
            held = [
                (name, f"{claim.lease}:{n}")
                for claim in list(self._renewed)
                for name, (_, count) in claim.wanted.items()
                for n in range(1, count + 1)
            ]
            if held:
                found = await self._keep(held, int(LEASE_S * 1e6))
                if found is not None and found < len(held):
                    meaning = "Redis lost slots this replica holds: the limits count fewer calls"
                    log.warning("concurrency_leases_lost", held=len(held), found=found, meaning=meaning)

    async def _keep(self, held: list[tuple[str, str]], life_us: int) -> int | None:
        try:
            return await self._store.keep_slots(held, life_us)
        except StoreUnavailable as exc:
            self._fall_back(exc)
            return None  # a lease not renewed or released lapses by itself

    def _background(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    def _fall_back(self, exc: StoreUnavailable) -> None:
        now = self._timer()
        # For a while each replica counts alone without asking: a Redis that stalls must not hold every request.
        self._local_until = now + _LOCAL_AFTER_FAILURE_S
        if now - self._fallback_logged >= _FALLBACK_LOG_S:
            self._fallback_logged = now
            log.warning("concurrency_limits_local", reason=str(exc), meaning="each replica counts alone meanwhile")
