"""A key every replica agrees on (the principal key), kept in Redis and guarded against a value no replica wrote."""

from __future__ import annotations

import re

import structlog

from .redis_link import Corrupt, Inconsistent, text
from .resp import RespClient, RespError

log = structlog.get_logger(__name__)

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


async def agreed_secret(fast: RespClient, key: str, candidate: str) -> str:
    """The value under `key`, else `candidate`, stored now by whichever replica comes first. Redis errors, and
    Corrupt for a value that keeps being replaced by something else, are for the caller to report."""
    # No expiry: replicas started at any time later must find the same value. Written only if absent, so the first
    # replica's value wins and a Redis that lost it (restarted without persistence) gets it back. GET first: a
    # Redis refusing writes (maxmemory, read-only) still hands out a key that exists.
    stored, kind = await _read_secret(fast, key)
    if kind == "none":
        await fast.execute("SET", key, candidate, "NX")
        stored, kind = await _read_secret(fast, key)
    problem = _secret_problem(stored, kind)
    if problem is not None:
        # Not a key any replica wrote (emptied or overwritten by hand, another program's): replaced, only if it is
        # still that same value, so that replicas racing to replace it converge on one key.
        log.warning("principal_key_invalid", key=key, reason=problem, action="replaced")
        await fast.execute("EVAL", _REPLACE_SECRET, 1, key, kind, stored or b"", candidate)
        stored, kind = await _read_secret(fast, key)
        problem = _secret_problem(stored, kind)
        if problem is not None:  # something keeps writing there: refuse it rather than adopt it
            raise Corrupt(f"{key} {problem}, again after it was replaced")
    assert stored is not None
    return stored.decode()


async def _read_secret(fast: RespClient, key: str) -> tuple[bytes | None, str]:
    """The value under `key` and its Redis type ("none" when absent); a value of another type is not read."""
    try:
        stored = await fast.execute("GET", key)
    except RespError as exc:
        if not str(exc).startswith("WRONGTYPE"):
            raise
        kind = await fast.execute("TYPE", key)
        return None, text(kind)
    if stored is not None and not isinstance(stored, bytes):
        raise Inconsistent("GET answered something that is not a string")
    return stored, "none" if stored is None else "string"


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
