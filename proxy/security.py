"""Who is calling (task ownership, keyed hashes of credentials) and which Host and Origin may call at all."""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import hmac
import os
import secrets
import time
from collections.abc import Callable
from typing import Any

import structlog
from cachetools import TTLCache
from multidict import MultiMapping
from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential

from .config import ProxyConfig, SecurityConfig
from .jsonrpc import INTERNAL_ERROR, JsonRpcError, dumps
from .store.base import StoreUnavailable, TaskStore
from .tokens import TokenRefused, TokenVerifier

log = structlog.get_logger(__name__)
SHARED_KEY_NAME = "principal-key"

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]", "::1")
_HASHES_KEPT = 512
_KEPT_VALUE_CHARS = 2048
"""Hashes of values up to this long are kept, the credentials a replica sees again with every request: 512 of
them hold about 1 MB of ASCII tokens, 4 MB at most (Python keeps a string of 4-byte characters at 4 bytes each). A
longer value is hashed each time."""


class Identity:
    """Keyed hashes of who calls, so that logs and the store never hold a credential, nor one that can be guessed
    back from its hash. The key is, in this order: `security.principal_key`, MCP_TASKS_PROXY_PRINCIPAL_KEY, the
    one kept in a shared store (made by the first replica), a random one of this process."""

    def __init__(self, config: SecurityConfig, *, shared_store: bool = False) -> None:
        explicit = config.principal_key or os.environ.get("MCP_TASKS_PROXY_PRINCIPAL_KEY")
        self.from_store = shared_store and not explicit
        """The key is the store's: replicas sharing a Redis store then agree on owners without anyone setting it."""
        self.operator_key = explicit.encode() if explicit else None
        """The key the operator gave the replicas, kept out of the store: what seals calls for another replica to
        take over (proxy/tasks/sealing.py)."""
        self._key: bytes | None = None if self.from_store else (explicit or secrets.token_hex(32)).encode()
        self._mode = config.principal
        self._header = config.principal_header
        self.verifier = TokenVerifier(config) if config.principal == "jwt" else None
        """With principal: jwt, what checks every request's bearer token at the front door (proxy/tokens.py)."""
        # A bridged call asks for its caller's session key twice, a log line once more: an HMAC each (2 µs).
        self._kept_hashes = functools.lru_cache(maxsize=_HASHES_KEPT)(self._keyed_hash)

    @property
    def principal_header(self) -> str | None:
        """The header that names the caller when security.principal is "header"; else None."""
        return self._header if self._mode == "header" else None

    @property
    def keyed(self) -> bool:
        return self._key is not None

    async def agree(self, store: TaskStore) -> None:
        """Take the key kept in the store (putting this replica's there if it has none)."""
        mine = self._key.decode() if self._key is not None else secrets.token_hex(32)
        stored = await store.shared_secret(SHARED_KEY_NAME, mine)
        if self._key is None:
            log.info("principal_key_loaded", created=stored == mine)
        elif stored != mine:
            # Redis lost the key and another replica wrote its own first: everyone converges on the stored one.
            log.warning("principal_key_replaced", reason="the store holds another replica's key")
        if stored.encode() != self._key:
            self._kept_hashes.cache_clear()  # made with the key this replica no longer uses
        self._key = stored.encode()

    def _secret(self) -> bytes:
        if self._key is None:
            raise StoreUnavailable("the replicas' shared principal key is kept in the store, which has not answered")
        return self._key

    def durable_task_id(self, principal: str, session: str, request_id: Any, generation: int) -> str:
        """The task id of a durable call, from who asked, on which session, with which request id: any replica
        finds the call again from the client's notifications/cancelled, which names only the request id. A request
        id used again after its call ended (a client restarted against a server without sessions) takes the next
        `generation`."""
        return self._derived_id("durable", principal, session, request_id, generation)

    def keyed_task_id(self, principal: str, tool: str, key: str, kind: str) -> str:
        """The task id of a call with an idempotency key (proxy/clients/idempotency.py): from who asked, the tool, the
        key and the kind of task (a 2026 task, a SEP-1686 one), so that every replica derives the same one and the
        store's atomic create makes one task of them."""
        return self._derived_id("idempotency", kind, principal, tool, key)

    def mac(self, *parts: str) -> str:
        """A MAC of `parts` every replica computes alike, and nobody without the key can (a handle's binding)."""
        return self._hash(dumps(list(parts)).decode())

    def _derived_id(self, *parts: Any) -> str:
        """A task id every replica derives alike from `parts`, and nobody without the key can."""
        digest = hmac.new(self._secret(), dumps(list(parts)), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest[:18]).decode()  # 24 characters, a task id's alphabet

    def session_tag(self, headers: MultiMapping[str]) -> str:
        """The client's upstream session (Mcp-Session-Id), hashed; "" for a server without sessions."""
        session = headers.get("Mcp-Session-Id", "")
        return self._hash("session:" + session) if session else ""

    def _hash(self, value: str) -> str:
        return self._kept_hashes(value) if len(value) <= _KEPT_VALUE_CHARS else self._keyed_hash(value)

    def _keyed_hash(self, value: str) -> str:
        # surrogateescape: the bytes as sent, even those that are not UTF-8 (aiohttp keeps them as lone surrogates).
        return hmac.new(self._secret(), value.encode("utf-8", "surrogateescape"), hashlib.sha256).hexdigest()[:32]

    def credential(self, headers: MultiMapping[str]) -> str:
        """The caller's credential (Authorization), hashed; "" without one. Keys legacy sessions and MRTR handles."""
        authorization = headers.get("Authorization", "")
        return self._hash("authorization:" + authorization) if authorization else ""

    def principal(self, headers: MultiMapping[str]) -> str:
        """The owner of the tasks this request creates, and whose tasks it may see."""
        if self._mode == "none":
            return ""
        if self._mode == "header":
            value = headers.get(self._header, "")
            return self._hash("header:" + value) if value else ""
        if self.verifier is not None:  # the token's claims: the same caller whichever token it shows
            return self._hash("jwt:" + self.verifier.principal_of(headers))
        return self.credential(headers)

    def logged_principal(self, headers: MultiMapping[str]) -> str | None:
        """The principal for a log line: None when anonymous, or while the key is not loaded yet."""
        if self._key is None:
            return None
        if self.verifier is not None:  # a token verified at the front door, else none to name (a refusal's)
            try:
                caller = self.verifier.cached(headers)
            except TokenRefused:
                return None
            return self._hash("jwt:" + caller.principal) if caller is not None else None
        return self.principal(headers) or None


async def keep_shared_key(identity: Identity, store: TaskStore, *, interval_s: float) -> None:
    """Load the store's key until it answers, then check it every `interval_s`: a Redis restarted without
    persistence gets it back from the first replica to look, and every replica converges on that one."""
    retrying = AsyncRetrying(retry=retry_if_exception_type(StoreUnavailable), wait=wait_exponential(0.2, max=5))
    async for attempt in retrying:
        with attempt:
            await identity.agree(store)
    while True:
        await asyncio.sleep(interval_s)
        try:
            await identity.agree(store)
        except StoreUnavailable:
            continue  # the store's own log line says why; the key this replica holds stays valid meanwhile


def same_mac(given: str, expected: str) -> bool:
    """Whether a MAC a client sent is the one expected, in constant time. Compared as bytes: compare_digest refuses
    a str that is not ASCII, and a client's string may hold anything (a lone surrogate included)."""
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode())


ANONYMOUS = "address:"
"""How caller_of names an anonymous caller: by its network address, after this."""


def caller_of(principal: str, remote: str | None) -> str:
    """Who a request counts against for per-caller limits: its principal; for an anonymous request (no credential
    tells one such client from another), its network address, which a client cannot share or forge."""
    return principal or f"{ANONYMOUS}{remote or 'unknown'}"


class HostGuard:
    """Host and Origin checks against DNS rebinding (a browser page turning a loopback sidecar into its proxy)."""

    def __init__(self, config: ProxyConfig) -> None:
        loopback = config.listen.host in LOOPBACK_NAMES
        hosts = config.security.allowed_hosts
        origins = config.security.allowed_origins
        self._hosts = _Patterns(
            hosts if hosts is not None else (["127.0.0.1", "localhost", "[::1]"] if loopback else ["*"])
        )
        self._origins = _Patterns(
            origins
            if origins is not None
            else (["http://127.0.0.1", "http://localhost", "http://[::1]"] if loopback else [])
        )

    def host_allowed(self, host: str | None) -> bool:
        return host is not None and self._hosts.match(host.lower())

    def origin_allowed(self, origin: str | None) -> bool:
        return origin is None or self._origins.match(origin.lower())


class _Patterns:
    """Allowed values: a pattern matches itself with any port, or exactly with its own port; "*" matches anything.
    Set lookups, as every request is checked."""

    def __init__(self, patterns: list[str]) -> None:
        self._any = "*" in patterns
        self._exact = frozenset(pattern.lower() for pattern in patterns)

    def match(self, value: str) -> bool:
        if self._any or value in self._exact:
            return True
        base, colon, port = value.rpartition(":")
        return bool(colon) and port.isdigit() and base in self._exact


class PollGuard:
    """The optional per-task polling rate limit (a MAY of SEP-2663): tasks/get on one task at most once per interval."""

    def __init__(self, min_interval_ms: int, *, timer: Callable[[], float] = time.monotonic) -> None:
        self._min_interval_s = min_interval_ms / 1000
        self._timer = timer
        # Bounded, and an entry is useless after the interval anyway.
        self._last: TTLCache[str, float] = TTLCache(maxsize=100_000, ttl=max(self._min_interval_s, 1), timer=timer)

    def check(self, task_id: str, poll_interval_ms: int) -> None:
        if self._min_interval_s <= 0:
            return
        now = self._timer()
        last = self._last.get(task_id)
        if last is not None and now - last < self._min_interval_s:
            interval_ms = max(poll_interval_ms, round(self._min_interval_s * 1000))  # what is enforced, not less
            raise JsonRpcError(
                INTERNAL_ERROR,
                f"Polling too fast: poll this task at most every {interval_ms} ms",
                {"pollIntervalMs": interval_ms},
                http_status=429,
            )
        self._last[task_id] = now
