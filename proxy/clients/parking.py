"""Calls held open upstream while a synchronous 2026 client answers an MRTR round, and a stdio child's own MRTR
state, which only that child can read.

The client's `requestState` is a handle to the parked call: HMAC-protected, bound to what the caller and the request
say they are, single-use, and dropped (the call cancelled upstream) when it expires or the table is full. The handle
names the replica that holds the call (`parked_owner`), so that a retry landing on another replica is forwarded to
it (proxy/front/session_routing.py); the MAC covers that name too. A 2026 stdio child's own `requestState` is
wrapped the same way (`ChildStates`): it names the replica and the copy of the server whose process sealed it.
"""

from __future__ import annotations

import asyncio
import base64
import contextvars
import hashlib
import hmac
import secrets
from collections.abc import Callable
from typing import Generic, TypeVar

import structlog
from cachetools import TTLCache

from ..jsonrpc import INVALID_PARAMS, JsonRpcError
from ..security import same_mac

log = structlog.get_logger(__name__)

T = TypeVar("T")


class _Expiring(TTLCache, Generic[T]):
    """A TTL table that tells its owner about every entry it drops unclaimed."""

    def __init__(self, maxsize: int, ttl: float, on_drop: Callable[[T, str], None]) -> None:
        super().__init__(maxsize=maxsize, ttl=ttl)
        self.on_drop = on_drop

    def expire(self, time: float | None = None) -> list[tuple[str, T]]:
        expired = super().expire(time)
        for _, item in expired:
            self.on_drop(item, "expired")
        return expired

    def popitem(self) -> tuple[str, T]:
        key, item = super().popitem()
        self.on_drop(item, "evicted")
        return key, item


class ParkedCalls(Generic[T]):
    def __init__(
        self,
        *,
        prefix: str,
        ttl_s: float,
        on_drop: Callable[[T, str], None],
        max_parked: int = 10_000,
        owner: Callable[[], str] | None = None,
    ) -> None:
        self._prefix = prefix
        self._owner = owner
        self._secret = secrets.token_bytes(32)
        self._ttl_s = ttl_s
        self._table: _Expiring[T] = _Expiring(max_parked, ttl_s, on_drop)
        self._sweeper: asyncio.Task[None] | None = None

    def owns(self, token: object) -> bool:
        """Whether `token` has the form of one of this table's handles (it may still be invalid or expired)."""
        return isinstance(token, str) and token.startswith(self._prefix + ".")

    def park(self, item: T, binding: str) -> str:
        """Hold `item`; the returned token gives it back once, to a claim with the same binding."""
        if self._sweeper is None or self._sweeper.done():
            # Its own context: the lines it logs belong to no request (not the one that parked first).
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep(), context=contextvars.Context())
        handle = secrets.token_urlsafe(16)
        if self._owner is not None:
            handle = f"{_encoded(self._owner())}~{handle}"
        self._table[handle] = item
        return f"{self._prefix}.{handle}.{self._mac(handle, binding)}"

    def claim(self, token: object, binding: str) -> T | None:
        """The parked item `token` names, removed from the table; None for a forged, reused or expired token."""
        parts = token.split(".") if isinstance(token, str) else []
        if len(parts) != 3 or parts[0] != self._prefix:
            return None
        handle, mac = parts[1], parts[2]
        if not same_mac(mac, self._mac(handle, binding)):
            return None
        return self._table.pop(handle, None)

    def drop_oldest(self, which: Callable[[T], bool]) -> bool:
        """Drop the item parked longest of those `which` accepts (told to on_drop as "needed"); False if none."""
        for handle, item in list(self._table.items()):
            if which(item):
                del self._table[handle]
                self._table.on_drop(item, "needed")
                return True
        return False

    def __len__(self) -> int:
        return len(self._table)

    def drain(self) -> list[T]:
        """Everything still parked, removed without being dropped (the caller stops them itself)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        items = list(self._table.values())
        self._table.clear()
        return items

    def _mac(self, handle: str, binding: str) -> str:
        return _mac(self._secret, handle, binding)

    async def _sweep(self) -> None:
        # Expired calls are otherwise only noticed on the next access; an idle proxy must still cancel them.
        interval = max(0.5, min(self._ttl_s / 4, 10.0))
        while True:
            await asyncio.sleep(interval)
            self._table.expire()


class ChildStates:
    """A stdio 2026 child's own requestState, wrapped in a handle of the proxy's: the replica and the copy of the
    server that can read it (its SDK seals it with a key of its process), MAC-bound to the caller and the request,
    so that a retry on any replica reaches that copy, and no other caller can use it. Nothing is kept: the handle
    carries the state."""

    PREFIX = "mtp1c"

    def __init__(self) -> None:
        self._secret = secrets.token_bytes(32)
        self.owner: Callable[[], str] | None = None
        """This replica's id (the task runner's), when there is one to name."""

    def owns(self, token: object) -> bool:
        return isinstance(token, str) and token.startswith(self.PREFIX + ".")

    def seal(self, state: str, child: int, binding: str) -> str:
        owner = _encoded(self.owner()) if self.owner is not None else ""
        encoded = base64.urlsafe_b64encode(state.encode("utf-8", "surrogatepass")).decode().rstrip("=")
        handle = f"{owner}~{child}-{encoded}"
        return f"{self.PREFIX}.{handle}.{self._mac(handle, binding)}"

    def open(self, token: str, binding: str) -> tuple[int, str] | None:
        """The copy and the child's own state a handle names; None for a forged one, or one made for another caller
        or request."""
        parts = token.split(".")
        if len(parts) != 3 or not same_mac(parts[2], self._mac(parts[1], binding)):
            return None
        child, _, state = parts[1].partition("~")[2].partition("-")
        try:
            state = base64.urlsafe_b64decode(state + "=" * (-len(state) % 4)).decode("utf-8", "surrogatepass")
            return int(child), state
        except ValueError:  # (a handle this replica made always decodes)
            return None

    def _mac(self, handle: str, binding: str) -> str:
        return _mac(self._secret, handle, binding)


def _mac(secret: bytes, handle: str, binding: str) -> str:
    # surrogatepass: a client's string may hold lone surrogates, and must get "invalid", not a traceback.
    digest = hmac.new(secret, f"{handle}|{binding}".encode("utf-8", "surrogatepass"), hashlib.sha256)
    return base64.urlsafe_b64encode(digest.digest()).decode().rstrip("=")


def invalid_state() -> JsonRpcError:
    """A requestState the proxy cannot take: forged, used, expired, or another caller's (-32602)."""
    return JsonRpcError(INVALID_PARAMS, "Invalid or expired requestState", {"reason": "invalid_request_state"})


def _encoded(replica_id: str) -> str:
    return base64.urlsafe_b64encode(replica_id.encode()).decode().rstrip("=")


def parked_owner(token: object) -> str | None:
    """The replica a parked call's handle names (unauthenticated here: only that replica can check the handle)."""
    if not isinstance(token, str) or token.count(".") != 2:
        return None
    tag, tilde, _ = token.split(".")[1].partition("~")
    if not tilde or not tag or len(tag) > 400:
        return None
    try:
        return base64.urlsafe_b64decode(tag + "=" * (-len(tag) % 4)).decode()
    except (ValueError, UnicodeDecodeError):
        return None
