"""JSON-RPC envelope helpers, the error codes this proxy emits, and the one exception-to-wire boundary."""

from __future__ import annotations

import json
import math
import re
import sys
from itertools import chain, compress, repeat
from operator import is_
from typing import Any

import orjson

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
HEADER_MISMATCH = -32020
MISSING_REQUIRED_CLIENT_CAPABILITY = -32021
UNSUPPORTED_PROTOCOL_VERSION = -32022

# The 2026-07-28 HTTP transport's status table (as the official SDKs apply it); other codes travel with 200.
ERROR_HTTP_STATUS = {
    PARSE_ERROR: 400,
    INVALID_REQUEST: 400,
    INVALID_PARAMS: 400,
    HEADER_MISMATCH: 400,
    MISSING_REQUIRED_CLIENT_CAPABILITY: 400,
    UNSUPPORTED_PROTOCOL_VERSION: 400,
    METHOD_NOT_FOUND: 404,
}

RequestId = str | int | None


class JsonRpcError(Exception):
    """A protocol error the proxy answers itself: it becomes the `error` member of the response."""

    def __init__(self, code: int, message: str, data: Any = None, *, http_status: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data
        self.http_status = http_status if http_status is not None else ERROR_HTTP_STATUS.get(code, 200)

    def to_error(self) -> dict[str, Any]:
        return error_object(self.code, self.message, self.data)


class UpstreamError(Exception):
    """The upstream could not be reached, timed out, or answered something that is not JSON-RPC."""

    def __init__(self, reason: str, *, upstream: str, http_status: int = 502) -> None:
        super().__init__(reason)
        self.reason = reason
        self.upstream = upstream
        self.http_status = http_status

    def to_error(self) -> dict[str, Any]:
        # -32603 rather than -32000..-32019: the 2026 spec asks that the legacy range not be used.
        return error_object(INTERNAL_ERROR, f"Upstream failure: {self.reason}", {"upstream": self.upstream})


def error_object(code: int, message: str, data: Any = None) -> dict[str, Any]:
    err: dict[str, Any] = {"code": code, "message": message}
    if data is not None:
        err["data"] = data
    return err


def error_response(request_id: RequestId, error: dict[str, Any]) -> dict[str, Any]:
    # JSON-RPC requires `"id": null` when the request id could not be read.
    return {"jsonrpc": "2.0", "id": request_id, "error": error}


def result_response(request_id: RequestId, result: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "result": result}


_DIGITS = b"0123456789"
_ZEROED = bytes.maketrans(b"123456789", b"000000000")
"""Every digit as 0, so that a run of digits is found by a plain substring search (C), not a regex (30x slower)."""
_LONG_RUN = b"0" * 19
"""Digits enough for an integer orjson reads as a float."""
_HUGE_RUN = b"0" * 200
_LONG_EXPONENT = re.compile(rb"[eE][+-]?\d{3}")
"""With neither a 200-digit run nor a 3-digit exponent, no number can overflow a double (10^199 x 10^99 cannot)."""
_DOUBLE_MAX = sys.float_info.max


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:40]} overflows a double")
    return value


def _bounded_int(text: str) -> int:
    value = int(text)
    if abs(value) > _DOUBLE_MAX:  # what no peer that reads numbers as doubles (JavaScript, orjson) can read
        raise ValueError(f"the number {text[:40]}... overflows a double")
    return value


def loads(body: bytes | str) -> Any:
    """Parse strict JSON (RFC 8259): orjson, unless a number is long enough for orjson to read it as a float (an id
    past 64 bits must come back as the same integer), or it is something orjson refuses that the standard library
    may accept (escaped lone surrogates). Both refuse NaN, Infinity and numbers that overflow a double: they are
    not JSON, and would be re-encoded as null. Raises ValueError for anything that is not JSON."""
    raw = body.encode() if isinstance(body, str) else body
    # Fewer than 19 digits in all cannot make a long number: one C pass, sparing most bodies the second.
    zeroed = raw.translate(_ZEROED) if len(raw) - len(raw.translate(None, _DIGITS)) >= 19 else b""
    if _LONG_RUN not in zeroed:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass  # let the standard library decide, and raise its own error
    # A Python call per number only where a number may overflow a double: the C scanner's own otherwise (a body
    # of two million numbers took ten times orjson's time with the calls, three with the scanner alone).
    bounds = _HUGE_RUN in zeroed or _LONG_EXPONENT.search(raw) is not None
    numbers: dict[str, Any] = {"parse_float": _finite_float, "parse_int": _bounded_int} if bounds else {}
    try:
        # Strict UTF-8 (JSON text is UTF-8, RFC 8259): json.loads(bytes) would let encoded surrogates through.
        return json.loads(raw.decode("utf-8"), parse_constant=_not_json, **numbers)
    except RecursionError:
        raise ValueError("nested too deeply") from None  # one exception type for every caller to catch


MAX_DUMPS_DEPTH = 512
"""The deepest nesting `dumps` writes. orjson stops at 254 levels; the standard library's encoder recurses once per
level, so without a bound of its own a message would fail at a depth set by how deep the caller's stack happens to
be (the lane's and aiohttp's differ), and as a RecursionError. The proxy's stacks are far shallower than the
interpreter's limit less this."""


def dumps(message: Any) -> bytes:
    """Compact UTF-8 JSON. orjson on the hot path; the standard library for what orjson refuses: integers past
    64 bits (JSON-RPC ids may be), lone surrogates a client sent as escapes, which only ASCII output (escaped
    again) can carry back, and nesting past orjson's 254 levels. ValueError past MAX_DUMPS_DEPTH."""
    try:
        return orjson.dumps(message)
    except TypeError:
        if _nested_deeper(message, MAX_DUMPS_DEPTH):
            raise ValueError(f"nested more than {MAX_DUMPS_DEPTH} levels deep") from None
        try:
            return json.dumps(message, separators=(",", ":")).encode()
        except RecursionError:  # a caller already deep in its own stack: one exception type for every caller
            raise ValueError("nested too deeply for this call's stack") from None


def too_deep(message: Any, body: bytes) -> bool:
    """Whether `dumps` refuses `message` (parsed from `body`) for its nesting. Brackets are counted first (two C
    scans): only a body with more than MAX_DUMPS_DEPTH of them is walked."""
    return body.count(b"[") + body.count(b"{") > MAX_DUMPS_DEPTH and _nested_deeper(message, MAX_DUMPS_DEPTH)


def _nested_deeper(value: Any, limit: int) -> bool:
    """Whether arrays and objects nest more than `limit` levels in `value`: a walk level by level, with no stack of
    the caller's, each level's objects and arrays gathered by C loops (map, compress, chain). A body of a million
    small objects is walked in a fraction of its parse time (a Python loop an item took ten times it, about a
    second for 4 MB: time a client could take from every other request on the event loop)."""
    level = [value] if type(value) in _CONTAINERS else []
    depth = 0
    while level:
        if depth >= limit:
            return True
        types = list(map(type, level))
        objects = compress(level, map(is_, types, repeat(dict)))
        arrays = compress(level, map(is_, types, repeat(list)))
        children = list(chain(chain.from_iterable(map(dict.values, objects)), chain.from_iterable(arrays)))
        level = list(compress(children, map(_CONTAINERS.__contains__, map(type, children))))
        depth += 1
    return False


_CONTAINERS = frozenset({dict, list})
"""What JSON parses into that nests: messages are built of plain dicts and lists (parsed, or the proxy's own)."""


def is_valid_id(value: Any) -> bool:
    # bool is an int subclass in Python but not a JSON-RPC id.
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


def classify(message: Any) -> str:
    """Name the JSON-RPC shape of a decoded body: request, notification, response, batch, or invalid."""
    if isinstance(message, list):
        return "batch" if message else "invalid"
    if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
        return "invalid"
    if "method" in message:
        if not isinstance(message["method"], str):
            return "invalid"
        if "params" in message and not isinstance(message["params"], dict | list):
            return "invalid"
        if "id" not in message:
            return "notification"
        return "request" if is_valid_id(message["id"]) else "invalid"
    if ("result" in message) != ("error" in message) and "id" in message:
        return "response"
    return "invalid"
