"""This replica among the others sharing a Redis: its lease kept alive, and events to and from them over pub/sub.

Pub/sub drops what is sent while a subscriber is disconnected, so after every (re)subscription the runner is asked
to reconcile from the records (`on_resync`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from .base import EventHandler, StoreUnavailable
from .redis_keys import RedisKeys
from .redis_link import REDIS_ERRORS, Inconsistent, RedisLink, reason, text

log = structlog.get_logger(__name__)

_LEASE_RETRY_S = 0.5
"""After a failed lease renewal, how soon to try again (the next regular one may be too late)."""


class RedisReplicas:
    def __init__(self, link: RedisLink, keys: RedisKeys, *, lease_s: float) -> None:
        self._link = link
        self._keys = keys
        self._lease_ms = int(lease_s * 1000)
        self._tasks: list[asyncio.Task[None]] = []
        self._replica_id: str | None = None
        self.advertised: str | None = None
        """The lease's value: where the other replicas reach this one (session_routing.py); "1" without one."""

    async def start(
        self, replica_id: str, on_event: EventHandler, on_resync: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        """Keep the lease and the subscription alive from now on, whatever Redis does; wait for the first
        subscription (StoreUnavailable when Redis is not there yet: the loops go on trying)."""
        self._replica_id = replica_id
        subscribed = asyncio.get_running_loop().create_future()
        resync_wanted = asyncio.Event()
        self._tasks = [
            asyncio.ensure_future(self._keep_lease()),
            asyncio.ensure_future(self._listen(on_event, resync_wanted, subscribed)),
        ]
        if on_resync is not None:
            self._tasks.append(asyncio.ensure_future(self._resync_when_wanted(on_resync, resync_wanted)))
        # Events published from now on must reach this replica: return only once subscribed.
        async with self._link.answering("subscribe"):
            await asyncio.wait_for(asyncio.shield(subscribed), timeout=self._link.timeout_s)

    async def publish(self, event: dict[str, Any]) -> None:
        async with self._link.answering("publish"):
            reply = await self._link.fast.execute("PUBLISH", self._keys.events, json.dumps(event))
            if not isinstance(reply, int):
                raise Inconsistent("PUBLISH answered something other than a count")

    async def listeners(self) -> int:
        """The subscribers of the replicas' channel, this replica among them."""
        async with self._link.answering("listeners"):
            reply = await self._link.fast.execute("PUBSUB", "NUMSUB", self._keys.events)
            if not isinstance(reply, list) or len(reply) != 2 or not isinstance(reply[1], int):
                raise Inconsistent("PUBSUB NUMSUB did not answer a channel and a count")
            return reply[1]

    async def replica_url(self, replica_id: str) -> str | None:
        async with self._link.answering("lease"):
            value = await self._link.redis.get(self._keys.lease(replica_id))
        url = text(value) if isinstance(value, bytes) else None
        return url if url is not None and url.startswith(("http://", "https://")) else None

    async def is_alive(self, replica_id: str) -> bool:
        async with self._link.answering("lease"):
            return bool(await self._link.redis.exists(self._keys.lease(replica_id)))

    async def _renew_lease(self) -> None:
        assert self._replica_id is not None
        key = self._keys.lease(self._replica_id)
        async with self._link.answering("lease"):
            # PEXPIRE first: unlike SET it is allowed when Redis is at maxmemory, so a full Redis does not make
            # live replicas look lost. SET only when the key is gone (a Redis restarted without persistence).
            if not await self._link.redis.pexpire(key, self._lease_ms):
                await self._link.redis.set(key, self.advertised or "1", px=self._lease_ms)

    async def _keep_lease(self) -> None:
        while True:
            try:
                await self._renew_lease()
            except StoreUnavailable:  # logged; try again soon, the lease may be about to lapse
                await asyncio.sleep(_LEASE_RETRY_S)
                continue
            await asyncio.sleep(self._lease_ms / 3000)

    async def _listen(
        self,
        on_event: EventHandler,
        resync_wanted: asyncio.Event,
        subscribed: asyncio.Future[None],
    ) -> None:
        """Deliver every published event to this replica, reconnecting when Redis comes back.

        What was published while the subscription was down is lost to it: after each (re)subscription the runner
        re-reads what its tasks wait for (`on_resync`, run beside this loop so that events keep being read).
        """
        while True:
            # Subscribe confirmations are kept: redis-py reconnects and re-subscribes by itself after a dropped
            # connection, and its confirmation is the only sign that events may have been missed meanwhile.
            pubsub = self._link.redis.pubsub(ignore_subscribe_messages=False)
            try:
                await pubsub.subscribe(self._keys.events)
                async for message in pubsub.listen():
                    kind = message.get("type")
                    if kind == "subscribe":
                        if not subscribed.done():
                            subscribed.set_result(None)
                        resync_wanted.set()
                        continue
                    if kind != "message":
                        continue
                    try:
                        event = json.loads(message["data"])
                    except ValueError:
                        continue
                    if not isinstance(event, dict):
                        continue
                    try:
                        await on_event(event)
                    except Exception as exc:
                        log.warning("store_event_failed", event_type=event.get("type"), error=type(exc).__name__)
            except (TimeoutError, *REDIS_ERRORS, OSError, StoreUnavailable) as exc:
                self._link.failed("events", reason(exc, self._link.timeout_s))
                await asyncio.sleep(1)
            finally:
                with contextlib.suppress(*REDIS_ERRORS, OSError):
                    await pubsub.aclose()

    @staticmethod
    async def _resync_when_wanted(on_resync: Callable[[], Awaitable[None]], wanted: asyncio.Event) -> None:
        """One re-read at a time; a (re)subscription during one asks for one more after it."""
        while True:
            await wanted.wait()
            wanted.clear()
            try:
                await on_resync()
            except Exception as exc:  # the loop must outlive any one re-read
                log.warning("store_resync_failed", error=type(exc).__name__)

    async def aclose(self) -> None:
        """Stop the loops and give up the lease at once (other replicas need not wait for it to lapse)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._replica_id is not None:
            with contextlib.suppress(*REDIS_ERRORS, OSError):
                await self._link.redis.delete(self._keys.lease(self._replica_id))
