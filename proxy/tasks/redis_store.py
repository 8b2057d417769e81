"""Tasks in Redis (or Valkey), shared by several proxy replicas.

Records are JSON under one key prefix. Redis enforces the TTL: the deadline is set at creation (SET PX NX) and kept
by every update (SET XX KEEPTTL). Updates are optimistic: read the record, apply the change, then write it with a
compare-and-set script that succeeds only if the record is still the one read (its SHA-1), else read again; so a
terminal state is never overwritten, even by two replicas racing, in two round trips and without WATCH (which would
pin a connection per update). Each replica keeps a lease key alive; the ids of unfinished tasks are in one set, so
any replica can find the tasks of a replica whose lease lapsed. Events between replicas (a cancel, answers to an
input round) go over one pub/sub channel.

The per-task commands go over one pipelining connection (resp.py); leases, the sweep and pub/sub use redis-py.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import redis.asyncio as redis
import structlog
from redis.exceptions import RedisError

from .model import TaskRecord, from_json, to_json
from .resp import RespClient, RespError
from .store import EventHandler, StoreUnavailable, Updater

log = structlog.get_logger(__name__)

TASK_KEY_PREFIX = "mcp-tasks-proxy:"

# KEYS: the task, the running set. ARGV: SHA-1 of the value the update was computed from, the new value, "1" when
# the new status is terminal, the task id. Returns 1 when written, 0 when the record changed meanwhile, -1 when gone.
_COMPARE_AND_SET = b"""
local current = redis.call('GET', KEYS[1])
if not current then return -1 end
if redis.sha1hex(current) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'XX', 'KEEPTTL')
if ARGV[3] == '1' then redis.call('SREM', KEYS[2], ARGV[4]) end
return 1
"""
_COMPARE_AND_SET_SHA = hashlib.sha1(_COMPARE_AND_SET, usedforsecurity=False).hexdigest()


class RedisTaskStore:
    shared = True

    def __init__(self, url: str, *, key_prefix: str = TASK_KEY_PREFIX, lease_s: float, timeout_s: float) -> None:
        self._prefix = key_prefix
        self._lease_ms = int(lease_s * 1000)
        self._timeout_s = timeout_s
        self._redis = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry_on_timeout=False,
            health_check_interval=30,
        )
        self._fast = RespClient(url, timeout_s=timeout_s)
        self._running_key = f"{key_prefix}running"
        self._channel = f"{key_prefix}events"
        self._tasks: list[asyncio.Task[None]] = []
        self._replica_id: str | None = None

    def _key(self, task_id: str) -> str:
        return f"{self._prefix}task:{task_id}"

    def _lease_key(self, replica_id: str) -> str:
        return f"{self._prefix}replica:{replica_id}"

    @asynccontextmanager
    async def _answering(self, what: str) -> AsyncIterator[None]:
        """One place where Redis failures become StoreUnavailable, with the cause logged once."""
        try:
            yield
        except (TimeoutError, RedisError, RespError, OSError) as exc:
            log.warning("store_unavailable", operation=what, reason=type(exc).__name__)
            raise StoreUnavailable(f"the task store did not answer ({type(exc).__name__})") from exc

    async def create(self, record: TaskRecord) -> None:
        key = self._key(record.task_id)
        commands: list[tuple[str | bytes | int, ...]] = [("MULTI",)]
        commands.append(("SET", key, to_json(record), "PX", record.ttl_ms, "NX"))
        if not record.is_terminal:
            commands.append(("SADD", self._running_key, record.task_id))
        commands.append(("EXEC",))
        async with self._answering("create"):
            replies = await self._fast.pipeline(commands)
        created = replies[-1][0] if isinstance(replies[-1], list) else None
        if created is None:
            raise StoreUnavailable(f"task id collision for {record.task_id}")  # 128 random bits: never in practice

    async def get(self, task_id: str) -> TaskRecord | None:
        async with self._answering("get"):
            raw = await self._fast.execute("GET", self._key(task_id))
        return from_json(raw) if isinstance(raw, bytes) else None

    async def update(self, task_id: str, updater: Updater) -> TaskRecord | None:
        key = self._key(task_id)
        async with self._answering("update"):
            raw = await self._fast.execute("GET", key)
            while True:
                if not isinstance(raw, bytes):
                    return None
                current = from_json(raw)
                new = updater(current)  # may raise TaskStateError: nothing is written
                if new is current:
                    return current
                written = await self._compare_and_set(key, raw, new)
                if written == 1:
                    return new
                if written == -1:
                    return None
                raw = await self._fast.execute("GET", key)  # another replica changed it first: re-apply on that

    async def _compare_and_set(self, key: str, raw: bytes, new: TaskRecord) -> int:
        read = hashlib.sha1(raw, usedforsecurity=False).hexdigest()  # a fingerprint, not a security measure
        args = (2, key, self._running_key, read, to_json(new), int(new.is_terminal), new.task_id)
        try:
            written = await self._fast.execute("EVALSHA", _COMPARE_AND_SET_SHA, *args)
        except RespError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
            written = await self._fast.execute("EVAL", _COMPARE_AND_SET, *args)  # loads it for the next EVALSHA
        assert isinstance(written, int)
        return written

    async def ping(self) -> None:
        async with self._answering("ping"):
            await self._redis.ping()

    async def start(self, replica_id: str, on_event: EventHandler) -> None:
        self._replica_id = replica_id
        await self._renew_lease()
        subscribed = asyncio.get_running_loop().create_future()
        self._tasks = [
            asyncio.ensure_future(self._keep_lease()),
            asyncio.ensure_future(self._listen(on_event, subscribed)),
        ]
        # Events published from now on must reach this replica: return only once subscribed.
        async with self._answering("subscribe"):
            await asyncio.wait_for(asyncio.shield(subscribed), timeout=self._timeout_s)

    async def publish(self, event: dict[str, Any]) -> None:
        async with self._answering("publish"):
            await self._fast.execute("PUBLISH", self._channel, json.dumps(event))

    async def running_task_ids(self) -> list[str]:
        async with self._answering("running"):
            members = await self._redis.smembers(self._running_key)
            ids = [m.decode() for m in members]
            if not ids:
                return []
            # Expired records leave their id behind; drop those here.
            exists = await asyncio.gather(*(self._redis.exists(self._key(task_id)) for task_id in ids))
            gone = [task_id for task_id, alive in zip(ids, exists, strict=True) if not alive]
            if gone:
                await self._redis.srem(self._running_key, *gone)
        return [task_id for task_id in ids if task_id not in gone]

    async def is_alive(self, replica_id: str) -> bool:
        async with self._answering("lease"):
            return bool(await self._redis.exists(self._lease_key(replica_id)))

    async def _renew_lease(self) -> None:
        assert self._replica_id is not None
        async with self._answering("lease"):
            await self._redis.set(self._lease_key(self._replica_id), "1", px=self._lease_ms)

    async def _keep_lease(self) -> None:
        while True:
            await asyncio.sleep(self._lease_ms / 3000)
            with contextlib.suppress(StoreUnavailable):  # logged; the next renewal tries again
                await self._renew_lease()

    async def _listen(self, on_event: EventHandler, subscribed: asyncio.Future[None]) -> None:
        """Deliver every published event to this replica, reconnecting when Redis comes back."""
        while True:
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self._channel)
                if not subscribed.done():
                    subscribed.set_result(None)
                async for message in pubsub.listen():
                    if message.get("type") != "message":
                        continue
                    try:
                        event = json.loads(message["data"])
                    except ValueError:
                        continue
                    try:
                        await on_event(event)
                    except Exception:
                        log.exception("store_event_failed", event_type=event.get("type"))
            except (TimeoutError, RedisError, OSError) as exc:
                log.warning("store_events_interrupted", reason=type(exc).__name__)
                await asyncio.sleep(1)
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._replica_id is not None:
            with contextlib.suppress(RedisError, OSError):
                await self._redis.delete(self._lease_key(self._replica_id))
        await self._fast.aclose()
        await self._redis.aclose()
