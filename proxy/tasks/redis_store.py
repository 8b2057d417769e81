"""Tasks in Redis (or Valkey), shared by several proxy replicas.

Records are JSON under one key prefix. Redis enforces the TTL: the deadline is set at creation (SET PX NX) and kept
by every update (SET XX KEEPTTL). Updates are optimistic: read the record, apply the change, then write it with a
compare-and-set script that succeeds only if the record is still the one read (its SHA-1), else read again; so a
terminal state is never overwritten, even by two replicas racing, in two round trips and without WATCH (which would
pin a connection per update). Each replica keeps a lease key alive; the ids of unfinished tasks are in one set, so
any replica can find the tasks of a replica whose lease lapsed. Events between replicas (a cancel, answers to an
input round, changes for listeners) go over one pub/sub channel; pub/sub drops what is sent while a subscriber is
disconnected, so the runner reconciles from the records after every (re)subscription and on a slow timer.

The per-task commands go over one pipelining connection (resp.py); leases, the sweep and pub/sub use redis-py.
Every reply is checked for the shape its command gives: one that cannot be right (a record of another task, a
script result out of range) drops the connection, so that a desynchronised stream answers nobody else.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import redis.asyncio as redis
import structlog
from redis.exceptions import RedisError, ResponseError

from .model import TaskRecord, from_json, to_json
from .resp import DEFAULT_MAX_REPLY_BYTES, RespClient, RespError
from .store import EventHandler, StoreUnavailable, TaskIdTaken, Updater

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

_LEASE_RETRY_S = 0.5
"""After a failed lease renewal, how soon to try again (the next regular one may be too late)."""


_INDEX_TIES = 64
"""Entries read past a page's end, for those that share the cursor's score (told apart by task id)."""


_SECRET = re.compile(rb"[!-~]{32,1024}")
"""A shared key as a replica could have written it: 32 to 1024 printable ASCII characters (they write 64 hex)."""

# KEYS: the key. ARGV: the type read, the value read ("" unless a string), the replacement. Replaces only what was
# read (a replica racing to replace it too finds another value and keeps it).
_REPLACE_SECRET = b"""
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind ~= ARGV[1] then return 0 end
if kind == 'string' and redis.call('GET', KEYS[1]) ~= ARGV[2] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('SET', KEYS[1], ARGV[3])
return 1
"""


def _secret_problem(stored: bytes | None, kind: str) -> str | None:
    """What makes a stored shared key unusable, or None."""
    if kind != "string":
        return f"holds a Redis {kind}, not a string"
    assert stored is not None
    if not stored:
        return "is empty"
    if _SECRET.fullmatch(stored) is None:
        return "is not a key of the proxy's (32 to 1024 printable ASCII characters)"
    return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _Inconsistent(Exception):
    """A reply that its command cannot give: the connection's replies may be shifted."""


class _Corrupt(Exception):
    """A stored record that is not a task record (hand-edited, or written by an incompatible version)."""


def _reason(exc: BaseException, timeout_s: float) -> str:
    """What went wrong, in words an operator can act on (never a credential: Redis errors do not echo them)."""
    if isinstance(exc, TimeoutError):
        return f"Redis did not answer within {timeout_s:g} s (store.timeout_s)"
    if isinstance(exc, _Inconsistent):
        return f"Redis sent a reply that cannot be right ({exc}); the connection was reset"
    text = str(exc).strip() or type(exc).__name__
    if text.startswith("OOM"):
        return f"Redis refused the write: it is out of memory (maxmemory): {text}"
    if text.startswith(("WRONGPASS", "NOAUTH", "NOPERM")) or isinstance(exc, redis.AuthenticationError):
        return f"Redis refused the credentials of store.url: {text}"
    return text


class RedisTaskStore:
    shared = True

    def __init__(
        self,
        url: str,
        *,
        key_prefix: str = TASK_KEY_PREFIX,
        lease_s: float,
        timeout_s: float,
        max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES,
    ) -> None:
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
        self._fast = RespClient(url, timeout_s=timeout_s, max_reply_bytes=max_reply_bytes)
        self._running_key = f"{key_prefix}running"
        self._channel = f"{key_prefix}events"
        self._tasks: list[asyncio.Task[None]] = []
        self._replica_id: str | None = None
        self._last_failure = time.monotonic()
        """When a Redis call last failed (or the store was made): the sweep waits a lease after it."""
        self.events_state = "not subscribed"
        self._policy_said: str | None = None
        self._policy_unknown_said = False
        self.failures: collections.Counter[str] = collections.Counter()

    def _key(self, task_id: str) -> str:
        return f"{self._prefix}task:{task_id}"

    def _lease_key(self, replica_id: str) -> str:
        return f"{self._prefix}replica:{replica_id}"

    def healthy_for(self) -> float:
        """Seconds since a Redis call last failed on this replica."""
        return time.monotonic() - self._last_failure

    @asynccontextmanager
    async def _answering(self, what: str) -> AsyncIterator[None]:
        """One place where Redis failures become StoreUnavailable, with the cause logged once."""
        try:
            yield
        except _Corrupt as exc:
            self.failures[what] += 1
            log.error("store_record_corrupt", operation=what, reason=str(exc))
            raise StoreUnavailable(str(exc)) from exc
        except (TimeoutError, RedisError, RespError, OSError, _Inconsistent) as exc:
            self._last_failure = time.monotonic()
            self.failures[what] += 1
            if isinstance(exc, _Inconsistent):
                self._fast.reset(str(exc))
            reason = _reason(exc, self._timeout_s)
            log.warning("store_unavailable", operation=what, reason=reason)
            raise StoreUnavailable(reason) from exc

    async def create(self, record: TaskRecord) -> None:
        key = self._key(record.task_id)
        commands: list[tuple[str | bytes | int, ...]] = [("MULTI",)]
        commands.append(("SET", key, to_json(record), "PX", record.ttl_ms, "NX"))
        if not record.is_terminal:
            commands.append(("SADD", self._running_key, record.task_id))
        commands.append(("EXEC",))
        async with self._answering("create"):
            replies = await self._fast.pipeline(commands)
            executed = replies[-1]
            if not isinstance(executed, list) or len(executed) != len(commands) - 2:
                raise _Inconsistent("EXEC did not answer one reply per queued command")
            for reply in executed:
                if isinstance(reply, RespError):
                    raise reply  # e.g. OOM: nothing was written
            created = executed[0]
        if created is None:
            raise TaskIdTaken(record.task_id)  # random ids never collide; a durable call's derived one may

    async def index_add(self, index: str, task_id: str, score: int, ttl_ms: int) -> None:
        """Scores are expiry times in microseconds: members whose task has expired are dropped here, and the list
        lives as long as its longest-lived task."""
        key = f"{self._prefix}index:{index}"
        now_us = int(time.time() * 1_000_000)
        async with self._answering("index_add"):
            replies = await self._fast.pipeline(
                [("ZADD", key, score, task_id), ("ZREMRANGEBYSCORE", key, "-inf", now_us), ("PTTL", key)]
            )
            if isinstance(replies[-1], int) and replies[-1] < ttl_ms:  # never shorten it for a longer-lived task
                await self._fast.execute("PEXPIRE", key, ttl_ms)

    async def index_page(self, index: str, after: tuple[int, str] | None, limit: int) -> list[tuple[str, int]]:
        key = f"{self._prefix}index:{index}"
        low = "-inf" if after is None else str(after[0])  # inclusive: ties on the score are told apart by id
        async with self._answering("index_page"):
            reply = await self._fast.execute(
                "ZRANGE", key, low, "+inf", "BYSCORE", "LIMIT", 0, limit + _INDEX_TIES, "WITHSCORES"
            )
            if isinstance(reply, list) and all(isinstance(pair, list) and len(pair) == 2 for pair in reply):
                flat = [item for pair in reply for item in pair]  # RESP3 answers pairs
            elif isinstance(reply, list) and not len(reply) % 2:
                flat = reply
            else:
                raise _Inconsistent("ZRANGE did not answer member, score pairs")
        pairs = [(_text(flat[n]), int(float(_text(flat[n + 1])))) for n in range(0, len(flat), 2)]
        return [(task_id, score) for task_id, score in pairs if after is None or (score, task_id) > after][:limit]

    async def index_remove(self, index: str, task_ids: list[str]) -> None:
        if task_ids:
            async with self._answering("index_remove"):
                await self._fast.execute("ZREM", f"{self._prefix}index:{index}", *task_ids)

    async def get(self, task_id: str) -> TaskRecord | None:
        async with self._answering("get"):
            return self._record(task_id, await self._fast.execute("GET", self._key(task_id)))

    def _record(self, task_id: str, raw: Any) -> TaskRecord | None:
        if raw is None:
            return None
        if not isinstance(raw, bytes):
            raise _Inconsistent("GET answered something other than a string")
        try:
            record = from_json(raw)
        except (ValueError, TypeError, KeyError) as exc:
            if raw.startswith(b"{"):
                # A JSON object is no other command's reply: this key's data is bad, the connection is fine.
                raise _Corrupt(f"the stored record of task {task_id} does not parse") from exc
            raise _Inconsistent("a task record that does not parse") from exc
        if record.task_id != task_id:
            raise _Inconsistent("GET answered another task's record")
        return record

    async def update(self, task_id: str, updater: Updater) -> TaskRecord | None:
        key = self._key(task_id)
        async with self._answering("update"):
            raw = await self._fast.execute("GET", key)
            while True:
                current = self._record(task_id, raw)
                if current is None:
                    return None
                new = updater(current)  # may raise TaskStateError: nothing is written
                if new is current:
                    return current
                assert isinstance(raw, bytes)
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
        if written not in (-1, 0, 1) or isinstance(written, bool):
            raise _Inconsistent("the compare-and-set script answered out of its range")
        assert isinstance(written, int)
        return written

    async def ping(self) -> None:
        """A write, not a PING: a Redis that answers but refuses writes (maxmemory, a read-only replica) cannot
        take tasks, and /readyz should say so and why."""
        async with self._answering("ping"):
            if await self._fast.execute("SET", f"{self._prefix}readyz", "1", "PX", 10_000) != b"OK":
                raise _Inconsistent("SET was not answered with OK")

    async def eviction_risk(self) -> str | None:
        """Why this Redis may lose task records under memory pressure, or None. Every maxmemory-policy but
        noeviction evicts keys (volatile-*: those with a TTL, which task records and replica leases all have), and a
        running task whose record or whose owner's lease is evicted is lost while its call goes on. Read with INFO,
        else CONFIG GET (managed services often disable CONFIG); when neither may be read, that is said once. A
        Redis out of reach is no risk to report: ping says it."""
        refused: list[str] = []
        policy: Any = None
        for what, read in (
            ("INFO memory", lambda: self._redis.info("memory")),
            ("CONFIG GET", lambda: self._redis.config_get("maxmemory-policy")),
        ):
            try:
                answer = await asyncio.wait_for(read(), self._timeout_s)
            except ResponseError as exc:
                refused.append(f"{what}: {exc}")
                continue
            except (RedisError, OSError, TimeoutError):
                return None
            policy = (
                answer.get("maxmemory_policy", answer.get("maxmemory-policy")) if isinstance(answer, dict) else None
            )
            if policy is not None:
                break
        if policy is None:
            if not self._policy_unknown_said:
                self._policy_unknown_said = True
                log.warning(
                    "store_eviction_policy_unknown",
                    reason="; ".join(refused) or "neither INFO nor CONFIG GET names it",
                    advice="make sure Redis runs with maxmemory-policy noeviction",
                )
            return None
        policy = _text(policy)
        if policy == "noeviction":
            self._policy_said = policy
            return None
        evicts = "any key" if policy.startswith("allkeys") else "keys with a TTL"
        risk = (
            f"Redis maxmemory-policy is {policy}: under memory pressure it evicts {evicts}, task records and replica "
            "leases included, and running tasks are lost; set maxmemory-policy noeviction"
        )
        if self._policy_said != policy:
            self._policy_said = policy
            log.warning("store_eviction_policy", policy=policy, risk=risk)
        return risk

    async def shared_secret(self, name: str, candidate: str) -> str:
        key = f"{self._prefix}{name}"
        async with self._answering("shared_secret"):
            # No expiry: replicas started at any time later must find the same value. Written only if absent, so
            # the first replica's value wins and a Redis that lost it (restarted without persistence) gets it back.
            # GET first: a Redis refusing writes (maxmemory, read-only) still hands out a key that exists.
            stored, kind = await self._read_secret(key)
            if kind == "none":
                await self._fast.execute("SET", key, candidate, "NX")
                stored, kind = await self._read_secret(key)
            problem = _secret_problem(stored, kind)
            if problem is not None:
                # Not a key any replica wrote (emptied or overwritten by hand, another program's): replaced, only if
                # it is still that same value, so that replicas racing to replace it converge on one key.
                log.warning("principal_key_invalid", key=key, reason=problem, action="replaced")
                await self._fast.execute("EVAL", _REPLACE_SECRET, 1, key, kind, stored or b"", candidate)
                stored, kind = await self._read_secret(key)
                problem = _secret_problem(stored, kind)
                if problem is not None:  # something keeps writing there: refuse it rather than adopt it
                    raise _Corrupt(f"{key} {problem}, again after it was replaced")
        assert stored is not None
        return stored.decode()

    async def _read_secret(self, key: str) -> tuple[bytes | None, str]:
        """The value under `key` and its Redis type ("none" when absent); a value of another type is not read."""
        try:
            stored = await self._fast.execute("GET", key)
        except RespError as exc:
            if not str(exc).startswith("WRONGTYPE"):
                raise
            kind = await self._fast.execute("TYPE", key)
            return None, _text(kind)
        if stored is not None and not isinstance(stored, bytes):
            raise _Inconsistent("GET answered something that is not a string")
        return stored, "none" if stored is None else "string"

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
        async with self._answering("subscribe"):
            await asyncio.wait_for(asyncio.shield(subscribed), timeout=self._timeout_s)

    async def publish(self, event: dict[str, Any]) -> None:
        async with self._answering("publish"):
            reply = await self._fast.execute("PUBLISH", self._channel, json.dumps(event))
            if not isinstance(reply, int):
                raise _Inconsistent("PUBLISH answered something other than a count")

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

    async def still_running(self, task_ids: list[str]) -> set[str]:
        """Which of these tasks are not terminal yet (the running set is updated with every terminal write)."""
        running: set[str] = set()
        async with self._answering("running"):
            for start in range(0, len(task_ids), 1000):
                batch = task_ids[start : start + 1000]
                flags = await self._fast.execute("SMISMEMBER", self._running_key, *batch)
                if not isinstance(flags, list) or len(flags) != len(batch):
                    raise _Inconsistent("SMISMEMBER did not answer one flag per id")
                running.update(task_id for task_id, flag in zip(batch, flags, strict=True) if flag == 1)
        return running

    async def is_alive(self, replica_id: str) -> bool:
        async with self._answering("lease"):
            return bool(await self._redis.exists(self._lease_key(replica_id)))

    async def _renew_lease(self) -> None:
        assert self._replica_id is not None
        key = self._lease_key(self._replica_id)
        async with self._answering("lease"):
            # PEXPIRE first: unlike SET it is allowed when Redis is at maxmemory, so a full Redis does not make
            # live replicas look lost. SET only when the key is gone (a Redis restarted without persistence).
            if not await self._redis.pexpire(key, self._lease_ms):
                await self._redis.set(key, "1", px=self._lease_ms)

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
            pubsub = self._redis.pubsub(ignore_subscribe_messages=False)
            try:
                await pubsub.subscribe(self._channel)
                async for message in pubsub.listen():
                    kind = message.get("type")
                    if kind == "subscribe":
                        self.events_state = "ok"
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
            except (TimeoutError, RedisError, OSError, StoreUnavailable) as exc:
                self._last_failure = time.monotonic()
                self.events_state = f"resubscribing ({_reason(exc, self._timeout_s)})"
                log.warning("store_events_interrupted", reason=_reason(exc, self._timeout_s))
                await asyncio.sleep(1)
            finally:
                with contextlib.suppress(RedisError, OSError):
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
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._replica_id is not None:
            with contextlib.suppress(RedisError, OSError):
                await self._redis.delete(self._lease_key(self._replica_id))
        await self._fast.aclose()
        await self._redis.aclose()
