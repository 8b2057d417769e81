"""Tasks in Redis (or Valkey), shared by several proxy replicas: the records and the indexes of them.

Records are JSON under one key prefix (redis_keys.py). Redis enforces the TTL: the deadline is set at creation (SET
PX NX) and kept by every update (SET XX KEEPTTL). Updates are optimistic: read the record, apply the change, then
write it with a compare-and-set script that succeeds only if the record is still the one read (its SHA-1), else read
again; so a terminal state is never overwritten, even by two replicas racing, in two round trips and without WATCH
(which would pin a connection per update). The ids of unfinished tasks are in one set, so any replica can find the
tasks of a replica whose lease lapsed (redis_replicas.py: leases, and events between replicas over pub/sub).

The connections and what their failures become are in redis_link.py; the eviction-policy check in
redis_eviction.py; the principal key every replica agrees on in redis_secrets.py.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from ..tasks.model import TaskRecord, from_json, to_json
from .base import EventHandler, TaskIdTaken, Updater
from .redis_eviction import EvictionPolicyCheck
from .redis_keys import TASK_KEY_PREFIX, RedisKeys
from .redis_link import Corrupt, Inconsistent, RedisLink, TlsSettings, text
from .redis_replicas import RedisReplicas
from .redis_secrets import agreed_secret
from .resp import DEFAULT_MAX_REPLY_BYTES, RespError

# KEYS: the task, the running set, the task's sealed call, its owner's newest credential. ARGV: SHA-1 of the value
# the update was computed from, the new value, "1" when the new status is terminal, the task id. Returns 1 when
# written, 0 when the record changed meanwhile, -1 when gone. An ended task's call and credential (its client's
# credentials, sealed) are deleted with the same write.
_COMPARE_AND_SET = b"""
local current = redis.call('GET', KEYS[1])
if not current then return -1 end
if redis.sha1hex(current) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'XX', 'KEEPTTL')
if ARGV[3] == '1' then
  redis.call('SREM', KEYS[2], ARGV[4])
  redis.call('DEL', KEYS[3], KEYS[4])
end
return 1
"""
_COMPARE_AND_SET_SHA = hashlib.sha1(_COMPARE_AND_SET, usedforsecurity=False).hexdigest()

# KEYS: the task, the running set, the task's sealed call. ARGV: the record, its TTL in ms, "1" when it is running,
# the task id, the sealed call ("" for none). Returns 1 when created, 0 when the id is taken: then nothing is
# written (a MULTI would still run the SADD and SET queued after a refused SET NX, and replace the call of the task
# that holds the id).
_CREATE = b"""
if not redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2], 'NX') then return 0 end
if ARGV[3] == '1' then
  redis.call('SADD', KEYS[2], ARGV[4])
  if ARGV[5] ~= '' then redis.call('SET', KEYS[3], ARGV[5], 'PX', ARGV[2]) end
end
return 1
"""
_CREATE_SHA = hashlib.sha1(_CREATE, usedforsecurity=False).hexdigest()

# GCRA (the generic cell rate algorithm) on Redis's clock, so that replicas whose clocks differ count alike. KEYS: the
# limit's key. ARGV: the emission interval and the tolerance (interval x (burst - 1)), in microseconds, how many
# requests to count at once (a replica counts ahead: proxy/front/rates.py), and how many it counted before and did not
# use (given back first). The key holds the theoretical arrival time of the next request. Returns how many were
# counted (1 to ARGV[3], as many as the limit allows now), or when none is allowed, minus the microseconds until one
# would be.
_RATE = b"""
local now = redis.call('TIME')
now = tonumber(now[1]) * 1000000 + tonumber(now[2])
local interval = tonumber(ARGV[1])
local tat = (tonumber(redis.call('GET', KEYS[1]) or '0') or 0) - tonumber(ARGV[4]) * interval
if tat < now then tat = now end
local wait = tat - now - tonumber(ARGV[2])
if wait > 0 then
  if ARGV[4] ~= '0' then  -- what was given back stays given back
    redis.call('SET', KEYS[1], string.format('%.0f', tat), 'PX', math.ceil((tat - now) / 1000) + 1)
  end
  return -math.ceil(wait)
end
local counted = math.min(math.floor(-wait / interval) + 1, tonumber(ARGV[3]))
tat = tat + counted * interval
redis.call('SET', KEYS[1], string.format('%.0f', tat), 'PX', math.ceil((tat - now) / 1000) + 1)
return counted
"""
_RATE_SHA = hashlib.sha1(_RATE, usedforsecurity=False).hexdigest()

# Concurrency slots (limits.rates' concurrency) as leases in sorted sets, scored by their expiry on Redis's clock: a
# lost replica's slots lapse by themselves. KEYS: the limits' keys, each once (the first ARGV[4]), then the keys of
# leases given back first (the replica's releases since its last call). ARGV: the lease's name, its life in
# microseconds, whether to take it whatever the counts (1: a call taken over from a lost replica), how many keys are
# the limits', then per limit key the limit and how many slots the request takes, then the member given back from
# each further key. All or nothing: returns 0 when taken, else the index of a full key.
_SLOTS_TAKE = b"""
local now = redis.call('TIME')
now = tonumber(now[1]) * 1000000 + tonumber(now[2])
local n = tonumber(ARGV[4])
for j = n + 1, #KEYS do redis.call('ZREM', KEYS[j], ARGV[4 + n + j]) end
for i = 1, n do
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now)
  if ARGV[3] == '0' and redis.call('ZCARD', KEYS[i]) + tonumber(ARGV[4 + 2 * i]) > tonumber(ARGV[3 + 2 * i]) then
    return i
  end
end
local expiry = string.format('%.0f', now + tonumber(ARGV[2]))
local life_ms = math.ceil(tonumber(ARGV[2]) / 1000)
for i = 1, n do
  for m = 1, tonumber(ARGV[4 + 2 * i]) do redis.call('ZADD', KEYS[i], expiry, ARGV[1] .. ':' .. m) end
  redis.call('PEXPIRE', KEYS[i], life_ms)
end
return 0
"""
_SLOTS_TAKE_SHA = hashlib.sha1(_SLOTS_TAKE, usedforsecurity=False).hexdigest()

# Renew (ARGV[1]: the new life in microseconds) or, with ARGV[1] 0, release the leases named in ARGV[2..], each a
# member of the key at the same place in KEYS. When Redis held none of the leases renewed (it restarted empty), they
# are written again: their calls still run (one lease missing among others was released, and stays so). Returns how
# many leases were found.
_SLOTS_KEEP = b"""
local now = redis.call('TIME')
now = tonumber(now[1]) * 1000000 + tonumber(now[2])
local life = tonumber(ARGV[1])
local expiry = string.format('%.0f', now + life)
local found = 0
for i, key in ipairs(KEYS) do
  if life == 0 then
    found = found + redis.call('ZREM', key, ARGV[i + 1])
  else
    found = found + redis.call('ZADD', key, 'XX', 'CH', expiry, ARGV[i + 1])
  end
end
if life > 0 then
  for i, key in ipairs(KEYS) do
    if found == 0 then redis.call('ZADD', key, expiry, ARGV[i + 1]) end
    redis.call('PEXPIRE', key, math.ceil(life / 1000))
  end
end
return found
"""
_SLOTS_KEEP_SHA = hashlib.sha1(_SLOTS_KEEP, usedforsecurity=False).hexdigest()

_INDEX_TIES = 64
"""Entries read past a page's end, for those that share the cursor's score (told apart by task id)."""


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
        tls: TlsSettings | None = None,
    ) -> None:
        self._keys = RedisKeys(key_prefix)
        self._link = RedisLink(
            url, timeout_s=timeout_s, max_reply_bytes=max_reply_bytes, tls=tls, key_prefix=key_prefix
        )
        self._fast = self._link.fast
        self._replicas = RedisReplicas(self._link, self._keys, lease_s=lease_s)
        self._eviction = EvictionPolicyCheck(self._link)
        self.failures: Mapping[str, int] = self._link.failures

    def healthy_for(self) -> float:
        return self._link.healthy_for()

    async def create(self, record: TaskRecord, context: bytes | None = None) -> None:
        keys = (self._keys.task(record.task_id), self._keys.running, self._keys.context(record.task_id))
        running = not record.is_terminal
        args = (to_json(record), record.ttl_ms, int(running), record.task_id, context if running and context else b"")
        async with self._link.answering("create"):
            created = await self._script(_CREATE, _CREATE_SHA, keys, args)
        if created not in (0, 1) or isinstance(created, bool):
            raise Inconsistent("the create script answered out of its range")
        if created == 0:
            raise TaskIdTaken(record.task_id)  # random ids never collide; a durable or keyed call's derived one may

    async def index_add(self, index: str, task_id: str, score: int, ttl_ms: int) -> None:
        """Scores are expiry times in microseconds: members whose task has expired are dropped here, and the list
        lives as long as its longest-lived task."""
        key = self._keys.index(index)
        now_us = int(time.time() * 1_000_000)
        async with self._link.answering("index_add"):
            replies = await self._fast.pipeline(
                [("ZADD", key, score, task_id), ("ZREMRANGEBYSCORE", key, "-inf", now_us), ("PTTL", key)]
            )
            if isinstance(replies[-1], int) and replies[-1] < ttl_ms:  # never shorten it for a longer-lived task
                await self._fast.execute("PEXPIRE", key, ttl_ms)

    async def index_page(self, index: str, after: tuple[int, str] | None, limit: int) -> list[tuple[str, int]]:
        key = self._keys.index(index)
        low = "-inf" if after is None else str(after[0])  # inclusive: ties on the score are told apart by id
        async with self._link.answering("index_page"):
            reply = await self._fast.execute(
                "ZRANGE", key, low, "+inf", "BYSCORE", "LIMIT", 0, limit + _INDEX_TIES, "WITHSCORES"
            )
            if isinstance(reply, list) and all(isinstance(pair, list) and len(pair) == 2 for pair in reply):
                flat = [item for pair in reply for item in pair]  # RESP3 answers pairs
            elif isinstance(reply, list) and not len(reply) % 2:
                flat = reply
            else:
                raise Inconsistent("ZRANGE did not answer member, score pairs")
        pairs = [(text(flat[n]), int(float(text(flat[n + 1])))) for n in range(0, len(flat), 2)]
        return [(task_id, score) for task_id, score in pairs if after is None or (score, task_id) > after][:limit]

    async def index_remove(self, index: str, task_ids: list[str]) -> None:
        if task_ids:
            async with self._link.answering("index_remove"):
                await self._fast.execute("ZREM", self._keys.index(index), *task_ids)

    async def sizes(self, task_ids: list[str]) -> list[int]:
        if not task_ids:
            return []
        async with self._link.answering("get"):
            replies = await self._fast.pipeline([("STRLEN", self._keys.task(task_id)) for task_id in task_ids])
        if not all(isinstance(size, int) and not isinstance(size, bool) and size >= 0 for size in replies):
            raise Inconsistent("STRLEN answered something other than a length")
        return replies  # type: ignore[return-value]

    async def get(self, task_id: str) -> TaskRecord | None:
        async with self._link.answering("get"):
            return self._record(task_id, await self._fast.execute("GET", self._keys.task(task_id)))

    def _record(self, task_id: str, raw: Any) -> TaskRecord | None:
        if raw is None:
            return None
        if not isinstance(raw, bytes):
            raise Inconsistent("GET answered something other than a string")
        try:
            record = from_json(raw)
        except (ValueError, TypeError, KeyError) as exc:
            if raw.startswith(b"{"):
                # A JSON object is no other command's reply: this key's data is bad, the connection is fine.
                raise Corrupt(f"the stored record of task {task_id} does not parse") from exc
            raise Inconsistent("a task record that does not parse") from exc
        if record.task_id != task_id:
            raise Inconsistent("GET answered another task's record")
        return record

    async def call_context(self, task_id: str) -> bytes | None:
        async with self._link.answering("get"):
            sealed = await self._fast.execute("GET", self._keys.context(task_id))
        if sealed is not None and not isinstance(sealed, bytes):
            raise Inconsistent("GET answered something other than a string")
        return sealed

    async def update(self, task_id: str, updater: Updater) -> TaskRecord | None:
        key = self._keys.task(task_id)
        async with self._link.answering("update"):
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
        keys = (key, self._keys.running, self._keys.context(new.task_id), self._keys.credential(new.task_id))
        args = (read, to_json(new), int(new.is_terminal), new.task_id)
        written = await self._script(_COMPARE_AND_SET, _COMPARE_AND_SET_SHA, keys, args)
        if written not in (-1, 0, 1) or isinstance(written, bool):
            raise Inconsistent("the compare-and-set script answered out of its range")
        assert isinstance(written, int)
        return written

    async def rate(self, name: str, interval_us: int, tolerance_us: int, count: int = 1, unused: int = 0) -> int:
        """Count up to `count` requests against the rate limit `name` for every replica (GCRA), after giving back
        `unused` counted before: how many were counted (as many as it allows now), or when none is allowed, minus
        the microseconds until one would be."""
        async with self._link.answering("rate"):
            keys = (self._keys.rate(name),)
            counted = await self._script(_RATE, _RATE_SHA, keys, (interval_us, tolerance_us, count, unused))
            if not isinstance(counted, int) or isinstance(counted, bool) or counted == 0 or counted > count:
                raise Inconsistent("the rate script answered out of its range")
        return counted

    async def take_slots(
        self,
        names: list[str],
        wanted: list[tuple[int, int]],
        lease: str,
        life_us: int,
        *,
        force: bool = False,
        releasing: Sequence[tuple[str, str]] = (),
    ) -> int:
        """Take slots of concurrency limits for every replica, all or none: for each name, (limit, how many), after
        giving back the leases `releasing` (name, member). 0 when taken (members `lease:1`..), else the 1-based
        index of a name with too few free."""
        args: list[str | bytes | int] = [lease, life_us, int(force), len(names)]
        for limit, count in wanted:
            args += [limit, count]
        args += [member for _, member in releasing]
        keys = (*map(self._keys.slots, names), *(self._keys.slots(name) for name, _ in releasing))
        async with self._link.answering("slots"):
            full = await self._script(_SLOTS_TAKE, _SLOTS_TAKE_SHA, keys, tuple(args))
            if not isinstance(full, int) or isinstance(full, bool) or not 0 <= full <= len(names):
                raise Inconsistent("the slots script answered out of its range")
        return full

    async def keep_slots(self, held: list[tuple[str, str]], life_us: int) -> int:
        """Renew the leases `held` (name, member) for life_us, or release them (life_us 0); how many were found."""
        keys = tuple(self._keys.slots(name) for name, _ in held)
        async with self._link.answering("slots"):
            found = await self._script(_SLOTS_KEEP, _SLOTS_KEEP_SHA, keys, (life_us, *(member for _, member in held)))
            if not isinstance(found, int) or isinstance(found, bool) or found < 0:
                raise Inconsistent("the slots script answered out of its range")
        return found

    async def _script(self, body: bytes, sha: str, keys: tuple[str, ...], args: tuple[str | bytes | int, ...]) -> Any:
        try:
            return await self._fast.execute("EVALSHA", sha, len(keys), *keys, *args)
        except RespError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
            return await self._fast.execute("EVAL", body, len(keys), *keys, *args)  # loads it for the next EVALSHA

    async def ping(self) -> None:
        """A write, not a PING: a Redis that answers but refuses writes (maxmemory, a read-only replica) cannot
        take tasks, and /readyz should say so and why."""
        async with self._link.answering("ping"):
            if await self._fast.execute("SET", self._keys.readyz, "1", "PX", 10_000) != b"OK":
                raise Inconsistent("SET was not answered with OK")

    async def eviction_risk(self) -> str | None:
        return await self._eviction.risk()

    async def shared_secret(self, name: str, candidate: str) -> str:
        async with self._link.answering("shared_secret"):
            return await agreed_secret(self._fast, self._keys.shared(name), candidate)

    async def start(
        self, replica_id: str, on_event: EventHandler, on_resync: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        await self._replicas.start(replica_id, on_event, on_resync)

    async def publish(self, event: dict[str, Any]) -> None:
        await self._replicas.publish(event)

    async def listeners(self) -> int:
        return await self._replicas.listeners()

    async def put_credential(self, task_id: str, sealed: bytes, ttl_ms: int) -> None:
        await self._set("credential", self._keys.credential(task_id), sealed, ttl_ms)

    async def credential(self, task_id: str) -> bytes | None:
        return await self._get("credential", self._keys.credential(task_id))

    async def alias(self, name: str, task_id: str, ttl_ms: int) -> None:
        await self._set("alias", self._keys.alias(name), task_id, ttl_ms)

    async def aliased(self, name: str) -> str | None:
        found = await self._get("alias", self._keys.alias(name))
        return text(found) if found is not None else None

    async def _set(self, operation: str, key: str, value: str | bytes, ttl_ms: int) -> None:
        async with self._link.answering(operation):
            await self._fast.execute("SET", key, value, "PX", ttl_ms)

    async def _get(self, operation: str, key: str) -> bytes | None:
        async with self._link.answering(operation):
            found = await self._fast.execute("GET", key)
        if found is not None and not isinstance(found, bytes):
            raise Inconsistent("GET answered something other than a string")
        return found

    def advertise(self, url: str) -> None:
        self._replicas.advertised = url

    async def replica_url(self, replica_id: str) -> str | None:
        return await self._replicas.replica_url(replica_id)

    async def claim_session(self, tag: str, replica_id: str, ttl_ms: int) -> None:
        await self._set("session", self._keys.session(tag), replica_id, ttl_ms)

    async def session_owner(self, tag: str) -> str | None:
        found = await self._get("session", self._keys.session(tag))
        return text(found) if found is not None else None

    async def forget_session(self, tag: str) -> None:
        async with self._link.answering("session"):
            await self._fast.execute("DEL", self._keys.session(tag))

    async def forget_call_context(self, task_id: str) -> None:
        async with self._link.answering("forget_call"):
            await self._fast.execute("DEL", self._keys.context(task_id))

    async def running_task_ids(self) -> list[str]:
        async with self._link.answering("running"):
            members = await self._link.redis.smembers(self._keys.running)
            ids = [m.decode() for m in members]
            if not ids:
                return []
            # Expired records leave their id behind; drop those here. Asked in pipelines of a thousand, one
            # connection each: a command apiece at once took a connection each, past the pool's hundred.
            exists: list[Any] = []
            for start in range(0, len(ids), 1000):
                pipe = self._link.redis.pipeline(transaction=False)
                for task_id in ids[start : start + 1000]:
                    pipe.exists(self._keys.task(task_id))
                exists += await pipe.execute()
            gone = {task_id for task_id, alive in zip(ids, exists, strict=True) if not alive}
            if gone:
                await self._link.redis.srem(self._keys.running, *gone)
        return [task_id for task_id in ids if task_id not in gone]

    async def still_running(self, task_ids: list[str]) -> set[str]:
        """Which of these tasks are not terminal yet (the running set is updated with every terminal write)."""
        running: set[str] = set()
        async with self._link.answering("running"):
            for start in range(0, len(task_ids), 1000):
                batch = task_ids[start : start + 1000]
                flags = await self._fast.execute("SMISMEMBER", self._keys.running, *batch)
                if not isinstance(flags, list) or len(flags) != len(batch):
                    raise Inconsistent("SMISMEMBER did not answer one flag per id")
                running.update(task_id for task_id, flag in zip(batch, flags, strict=True) if flag == 1)
        return running

    async def is_alive(self, replica_id: str) -> bool:
        return await self._replicas.is_alive(replica_id)

    async def aclose(self) -> None:
        await self._replicas.aclose()
        await self._link.aclose()
