"""The Redis store's two connections and what their failures become.

The per-task commands go over one pipelining connection (resp.py); leases, the sweep and pub/sub use redis-py.
Every reply is checked for the shape its command gives: one that cannot be right (a record of another task, a
script result out of range) drops the connection, so that a desynchronised stream answers nobody else.
"""

from __future__ import annotations

import collections
import dataclasses
import ssl
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol

import redis.asyncio as redis
import structlog
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.sentinel import Sentinel
from redis.exceptions import RedisClusterException, RedisError

from .base import RecordCorrupt, StoreUnavailable
from .redis_target import parse_store_url
from .resp import RespClient, RespError

log = structlog.get_logger(__name__)


REDIS_ERRORS = (RedisError, RedisClusterException)
"""What redis-py raises when Redis fails (its cluster client's own errors are not RedisErrors)."""


class Inconsistent(Exception):
    """A reply that its command cannot give: the connection's replies may be shifted."""


class Corrupt(Exception):
    """A stored value that is not what the proxy writes there (hand-edited, or written by an incompatible version)."""


class Outage:
    """How Redis being away is logged: a warning when it goes, then at most one per back-off step (1 s, doubling up
    to 5 min) however many calls fail meanwhile, and one line when it answers again. Every failure still counts in
    the metrics (mcp_tasks_proxy_store_errors)."""

    FIRST_STEP_S = 1.0
    MAX_STEP_S = 300.0

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.down_since: float | None = None
        self._failures = 0
        self._step = self.FIRST_STEP_S
        self._next_report = 0.0
        self._back_at = -self.MAX_STEP_S

    def failed(self, what: str, said: str) -> None:
        now = self._clock()
        if self.down_since is None:
            if now - self._back_at > self._step:  # a new outage after a quiet step; a flapping Redis keeps its step
                self._step = self.FIRST_STEP_S
            self.down_since, self._failures = now, 0
        self._failures += 1
        if now < self._next_report:
            log.debug("store_unavailable", operation=what, reason=said)
            return
        if self._failures == 1:
            log.warning("store_unavailable", operation=what, reason=said)
        else:
            log.warning("store_still_unavailable", operation=what, reason=said, failures=self._failures,
                        down_s=round(now - self.down_since, 1), next_report_s=self._step)  # fmt: skip
        self._next_report = now + self._step
        self._step = min(self._step * 2, self.MAX_STEP_S)

    def over(self) -> None:
        now = self._clock()
        assert self.down_since is not None
        log.info("store_available_again", down_s=round(now - self.down_since, 1), failures=self._failures)
        self.down_since = None
        self._back_at = now


class TlsSettings(Protocol):
    """TLS to a rediss:// store as the store reads it: config.TlsConfig is one (the store does not import config,
    which imports the store's URL rules)."""

    @property
    def verify(self) -> bool: ...
    @property
    def ca_file(self) -> str | None: ...
    @property
    def cert_file(self) -> str | None: ...
    @property
    def key_file(self) -> str | None: ...
    def ssl_context(self) -> ssl.SSLContext: ...


@dataclasses.dataclass(frozen=True)
class SystemTls:
    """A store made without TLS settings: config.TlsConfig()'s defaults (the system's CAs, verified, no client
    certificate)."""

    verify: bool = True
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context()


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def reason(exc: BaseException, timeout_s: float) -> str:
    """What went wrong, in words an operator can act on (never a credential: Redis errors do not echo them)."""
    if isinstance(exc, TimeoutError):
        return f"Redis did not answer within {timeout_s:g} s (store.timeout_s)"
    if isinstance(exc, Inconsistent):
        return f"Redis sent a reply that cannot be right ({exc}); the connection was reset"
    said = str(exc).strip() or type(exc).__name__
    if said.startswith("OOM"):
        return f"Redis refused the write: it is out of memory (maxmemory): {said}"
    if said.startswith(("WRONGPASS", "NOAUTH", "NOPERM")) or isinstance(exc, redis.AuthenticationError):
        return f"Redis refused the credentials of store.url: {said}"
    return said


class RedisLink:
    def __init__(
        self, url: str, *, timeout_s: float, max_reply_bytes: int, tls: TlsSettings | None = None, key_prefix: str = ""
    ) -> None:
        self.timeout_s = timeout_s
        target = parse_store_url(url)
        tls = tls or SystemTls()
        common: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
        if target.tls:
            common.update(_redis_py_tls(tls))
            if target.sentinel:
                common["ssl"] = True  # (a rediss:// URL says so by itself)
        options = {**common, "retry_on_timeout": False, "health_check_interval": 30}
        address = None
        self._sentinel: Sentinel | None = None
        if target.sentinel:
            assert target.service is not None
            sentinel = self._sentinel = Sentinel(list(target.hosts), sentinel_kwargs=dict(common))
            credentials = {"username": target.username, "password": target.password, "db": target.db}
            self.redis = sentinel.master_for(target.service, redis_class=redis.Redis, **options, **credentials)
            service = target.service

            async def address() -> tuple[str, int]:  # asked at every connection: a failover is followed
                return await sentinel.discover_master(service)

        elif target.cluster:
            # redis-py's cluster client for leases, the sweep and pub/sub (it follows the layout by itself); the fast
            # connection goes to the node that holds the proxy's one slot (all its keys share a hash tag).
            if target.tls:
                common["ssl"] = True
            nodes = [ClusterNode(host, port) for host, port in target.hosts]
            cluster = RedisCluster(
                startup_nodes=nodes, username=target.username, password=target.password, **common,
                health_check_interval=30,
            )  # fmt: skip
            self.redis = cluster  # type: ignore[assignment]

            async def address() -> tuple[str, int]:
                await cluster.initialize()  # the layout, read once (and again by redis-py after a failure)
                node = cluster.get_node_from_key(key_prefix)
                return node.host, node.port

        else:
            self.redis = redis.Redis.from_url(url, **options)
        context = tls.ssl_context() if target.tls else None
        self.fast = RespClient(
            target, timeout_s=timeout_s, max_reply_bytes=max_reply_bytes, ssl_context=context, address=address
        )
        self._last_failure = time.monotonic()
        """When a Redis call last failed (or the store was made): the sweep waits a lease after it."""
        self.failures: collections.Counter[str] = collections.Counter()
        self.outage = Outage()

    def failed(self, what: str, said: str) -> None:
        """A Redis call failed: counted, logged as the outage's back-off allows, and the sweep waits a lease."""
        self._last_failure = time.monotonic()
        self.failures[what] += 1
        self.outage.failed(what, said)

    def healthy_for(self) -> float:
        """Seconds since a Redis call last failed on this replica."""
        return time.monotonic() - self._last_failure

    @asynccontextmanager
    async def answering(self, what: str) -> AsyncIterator[None]:
        """One place where Redis failures become StoreUnavailable, with the cause logged once."""
        try:
            yield
        except Corrupt as exc:
            self.failures[what] += 1
            log.error("store_record_corrupt", operation=what, reason=str(exc))
            raise RecordCorrupt(str(exc)) from exc
        except (TimeoutError, *REDIS_ERRORS, RespError, OSError, Inconsistent) as exc:
            if isinstance(exc, Inconsistent) or (isinstance(exc, RespError) and str(exc).startswith("READONLY")):
                # (READONLY: the node is a replica now, an old master after a failover: the next connection asks
                # Sentinel for the new one.)
                self.fast.reset(str(exc))
            said = reason(exc, self.timeout_s)
            self.failed(what, said)
            raise StoreUnavailable(said) from exc
        if self.outage.down_since is not None:
            self.outage.over()

    async def aclose(self) -> None:
        await self.fast.aclose()
        await self.redis.aclose()
        for client in self._sentinel.sentinels if self._sentinel is not None else ():
            await client.aclose()


def _redis_py_tls(tls: TlsSettings) -> dict[str, Any]:
    """The same TLS settings as the fast connection's (TlsConfig.ssl_context), in redis-py's terms."""
    return {
        "ssl_ca_certs": tls.ca_file,
        "ssl_certfile": tls.cert_file,
        "ssl_keyfile": tls.key_file,
        "ssl_cert_reqs": "required" if tls.verify else "none",
        "ssl_check_hostname": tls.verify,
    }
