"""Idempotency keys on task-creating calls: a request sent again with the key of one already made gets that same
task, running or finished, and never a second upstream call.

A key comes in the HTTP header `Idempotency-Key` (the IETF httpapi draft's field: a structured-field string, whose
quotes are optional here, as many clients send the bare value) or, for a client that cannot set headers, in
`params._meta["mcp-tasks-proxy/idempotencyKey"]`. It is scoped to the caller (principal) and the tool: the task id
is a keyed hash of the three (security.Identity.keyed_task_id), so every replica derives the same one, the store's
atomic create makes exactly one task of concurrent submissions, and the key lives exactly as long as its task's
record (the task's TTL). The request's fingerprint (the tool name and its arguments as canonical JSON) is kept in
the record: the same key with other arguments is refused.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from multidict import MultiMapping

from ..jsonrpc import INVALID_PARAMS, JsonRpcError
from .envelope import params_of

HEADER = "Idempotency-Key"
META_KEY = "mcp-tasks-proxy/idempotencyKey"
MAX_KEY_CHARS = 255
_KEY = re.compile(r"[\x21-\x7e][\x20-\x7e]*")
"""Visible ASCII (spaces inside): what an HTTP field value and a log line carry without escaping."""


def key_of(message: dict[str, Any], headers: MultiMapping[str]) -> str | None:
    """The request's idempotency key, or None; a malformed one, or two that differ, is refused (-32602)."""
    values = [_unquoted(value) for value in headers.getall(HEADER, ())]
    meta = params_of(message).get("_meta")
    if isinstance(meta, dict) and META_KEY in meta:
        values.append(meta[META_KEY])
    if not values:
        return None
    key = values[0]
    if any(value != key for value in values[1:]):
        raise JsonRpcError(INVALID_PARAMS, "Invalid params: the request carries two different idempotency keys")
    if not isinstance(key, str) or len(key) > MAX_KEY_CHARS or _KEY.fullmatch(key) is None:
        raise JsonRpcError(
            INVALID_PARAMS,
            f"Invalid params: an idempotency key ({HEADER} or _meta {META_KEY!r}) is 1 to {MAX_KEY_CHARS} visible "
            "ASCII characters",
        )
    return key


def _unquoted(value: str) -> str:
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] == '"':
        return value[1:-1].replace('\\"', '"').replace("\\\\", "\\")
    return value


def without_key(message: dict[str, Any]) -> dict[str, Any]:
    """The request without the proxy's own _meta key (the upstream never sees it)."""
    params = params_of(message)
    meta = params.get("_meta")
    if not isinstance(meta, dict) or META_KEY not in meta:
        return message
    return {**message, "params": {**params, "_meta": {k: v for k, v in meta.items() if k != META_KEY}}}


def fingerprint(tool: str, arguments: Any) -> str:
    """What must match for a key used again to mean the same request: the tool and its arguments, as canonical
    JSON (sorted keys, no spaces; the standard library, which also writes integers past 64 bits)."""
    canonical = json.dumps([tool, arguments], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()


def other_session(key: str) -> JsonRpcError:
    """A 2025-era client's key used on another session than its task's: that task is listed, read and asked on
    the session that made it, and running the call again is what the key forbids."""
    return JsonRpcError(
        INVALID_PARAMS,
        f"Invalid params: the idempotency key {key!r} was used on another session; its task is there",
        {"reason": "idempotency_key_other_session"},
        http_status=200,
    )


def key_reused(key: str) -> JsonRpcError:
    return JsonRpcError(
        INVALID_PARAMS,
        f"Invalid params: the idempotency key {key!r} was used for another request (another tool or other "
        "arguments); use a new key for a new request",
        {"reason": "idempotency_key_reused"},
    )
