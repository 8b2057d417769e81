"""Which requests the lane serves itself: what the head allows, from one pass over its fields, then what the body
says."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import httptools
from aiohttp.http_parser import SINGLETON_HEADERS
from multidict import CIMultiDict, istr

from ...clients.envelope import (
    TASK_METHODS,
    check_modern_request,
    check_reencodable,
    check_routing_headers,
    decode_header_value,
    upstream_body,
)
from ...config import TaskMode, ToolRule
from ...jsonrpc import JsonRpcError, classify, loads
from ...upstream.http.relay import HttpRelay
from .. import boundary
from ..context import MCP_PATH
from ..dispatch import route
from ..session_routing import may_name_a_parked_call
from .answers import LaneRequest

if TYPE_CHECKING:
    from .server import Lane

MAX_FIELDS = 100
MAX_FIELD_BYTES = 8190
"""aiohttp's server refuses longer lines and more fields: the lane hands such requests over rather than relay what
aiohttp would refuse."""
_MCP_PATH = MCP_PATH.encode()
_FRAMING, _LENGTH, _SINGLETON, _METHOD, _NAME = "framing", "length", "singleton", "method", "name"
_ROLES = {
    **dict.fromkeys((name.lower().encode() for name in SINGLETON_HEADERS), _SINGLETON),
    **dict.fromkeys((b"transfer-encoding", b"expect", b"upgrade"), _FRAMING),
    b"content-length": _LENGTH,
    b"mcp-method": _METHOD,
    b"mcp-name": _NAME,
}
"""What a header field is to the lane: one lookup per field (SINGLETON_HEADERS: aiohttp refuses a repeated one)."""
_NOT_LANES = frozenset({"subscriptions/listen", "server/discover"})


_SHARED_NAME_BYTES = 64
"""Longer header names are decoded per request, never kept: 1,024 names of 64 bytes at most, whatever clients send."""


@functools.lru_cache(maxsize=1024)
def _shared_name(raw: bytes) -> istr:
    """A header name, decoded once for every request that sends it: one string shared by each request's headers
    and by every working task that keeps them (10,000 tasks keep 0.8 KB each less), and an istr, whose lowercase
    form multidict computes once rather than per request. aiohttp's parser caches names of up to 64 bytes too."""
    return istr(raw.decode())


class Head:
    """One request head, read once: whether the lane reads the request (`ours`: a `POST /mcp` nothing about whose
    head only aiohttp's reader may judge; any other request is aiohttp's, with its connection), and whether the lane
    may serve it itself (`kind`: "relay", a request the proxy does not own; "owned", tasks/* or a tool the policy
    runs as a task; None: the application's handler answers it on the lane's connection, proxy/front/lane/handlers.py).
    The body decides in the end (proxy/front/lane/connection.py)."""

    __slots__ = ("ours", "kind", "tool", "rule", "chunked", "_rule_for")

    def __init__(
        self,
        parser: httptools.HttpRequestParser,
        url: bytes,
        fields: list[tuple[bytes, bytes]],
        *,
        max_body_bytes: int,
        rule_for: Callable[[str], ToolRule | None],
        short_ascii: bool = False,
    ) -> None:
        """`short_ascii`: the bytes read of the request so far, its head among them, are ASCII and no longer than
        one field may be, so no field needs those checks of its own."""
        self._rule_for = rule_for
        self.tool: str | None = None
        self.rule: ToolRule | None = None
        self.kind: str | None = None
        self.ours = False
        self.chunked = False
        """The body comes in chunks (Transfer-Encoding: chunked alone): the lane reads it, and keeps no trailer."""
        method = parser.get_method()
        if not (
            method == b"POST"
            and parser.get_http_version() == "1.1"
            and url.partition(b"?")[0] == _MCP_PATH
            and len(url) <= MAX_FIELD_BYTES
            and len(fields) <= MAX_FIELDS
        ):
            return
        lengths = 0
        length = mcp_method = name = None
        # ASCII, within bounds, no repeated singleton: nothing for aiohttp alone to judge (what the proxy says of a
        # header that is not UTF-8 is aiohttp's to say).
        plain = short_ascii or all(
            value.isascii() and len(value) <= MAX_FIELD_BYTES and len(field) <= MAX_FIELD_BYTES
            for field, value in fields
        )
        seen: set[bytes] = set()
        for field, value in fields:
            lower = field.lower()
            role = _ROLES.get(lower)
            if role is None:
                continue
            if role is _FRAMING:
                if lower == b"transfer-encoding" and not self.chunked and value.strip().lower() == b"chunked":
                    self.chunked = True
                    continue
                return  # aiohttp must read such a body as it arrives, or change the connection
            if role is _LENGTH:
                lengths += 1
                length = value
                try:
                    if int(value) > max_body_bytes:
                        return
                except ValueError:
                    return
            if not plain:
                continue  # only the framing matters now: aiohttp reads the request
            if role is _METHOD:
                mcp_method = value.decode().strip()
            elif role is _NAME:
                name = value
            elif lower in seen:  # a singleton, Content-Length included
                plain = False  # aiohttp refuses a repeated Host, Content-Type...: it must see the request
            else:
                seen.add(lower)
        if (self.chunked and lengths) or not plain:
            # Both framings (a request smuggled past a front proxy: aiohttp refuses it), or fields only aiohttp's
            # reader may judge (not ASCII, a repeated singleton): aiohttp reads it, and the connection from here on.
            return
        self.ours = True
        if not (lengths == 1 or self.chunked) or (not self.chunked and int(length) <= 0):  # type: ignore[arg-type]
            return  # no body: the application's handler answers
        if mcp_method is None:
            self.kind = "as_is"  # no 2026 routing header: a 2025-era client's, relayed untouched if the body agrees
        elif mcp_method in TASK_METHODS:
            self.kind = "owned"
        elif mcp_method.startswith("tasks/") or mcp_method in _NOT_LANES:
            return
        elif mcp_method == "tools/call" and name is not None:
            # A tool the policy runs as a task is known from the header, without reading the body (which must
            # agree: proxy/front/lane/connection.py checks).
            self.tool = decode_header_value(name.decode())
            self.rule = rule_for(self.tool) if self.tool is not None else None
            self.kind = "owned" if self.rule is not None and self.rule.task is not TaskMode.NEVER else "relay"
        else:
            self.kind = "relay"

    def rule_for(self, tool: str) -> ToolRule | None:
        """The policy's rule for `tool`: the one looked up from the head when the body names the same tool."""
        return self.rule if tool == self.tool and tool is not None else self._rule_for(tool)


def decoded_headers(fields: list[tuple[bytes, bytes]]) -> CIMultiDict[str]:
    """A head's fields (ASCII: `Head.ours`) as aiohttp's reader decodes them."""
    # llhttp keeps a value's trailing spaces and tabs; aiohttp strips them, and so must the lane, or `Bearer me ` would
    # be a caller of its own here and another on aiohttp's path (relayed_request_fields strips the relayed ones).
    return CIMultiDict(
        [
            (_shared_name(name) if len(name) <= _SHARED_NAME_BYTES else name.decode(), value.decode().rstrip(" \t"))
            for name, value in fields
        ]
    )


def lane_request(
    lane: Lane,
    head: Head,
    url: bytes,
    fields: list[tuple[bytes, bytes]],
    body: bytes,
) -> LaneRequest | None:
    """The request just read, when the lane serves it itself: what its head allowed, and its body says; None
    when the application's handler answers it (proxy/front/lane/handlers.py)."""
    if head.kind is None:
        return None
    if head.kind == "as_is":
        # An HTTP upstream of either era takes a 2025 client's requests as they are (over stdio the proxy holds
        # their sessions itself). A replica routing sessions records the ones it makes from the application's answers.
        # Not before the proxy knows the server takes them so (one that speaks 2026-07-28 only has them translated).
        relayed = isinstance(lane.gateway.relay, HttpRelay) and lane.gateway.passes_2025_as_is
        kind = "as_is" if relayed and not lane.routes_sessions else None
    else:
        kind = head.kind if head.kind == "owned" else lane.route()
    if kind is None:
        return None
    headers = decoded_headers(fields)
    if boundary.refused_by_guard(lane.guard, headers) is not None:
        return None  # the application answers the refusal, from the same check
    caller = boundary.allowed_on_lane(lane.verifier, headers)
    if not caller:
        return None  # the application verifies the token, or refuses it
    if lane.routes_sessions and ("Mcp-Session-Id" in headers or may_name_a_parked_call(body)):
        return None  # the application routes it to the replica that holds it
    try:
        message = loads(body)
    except ValueError:
        return None
    if classify(message) != "request":
        return None  # a notification, a response or a batch: the application's
    way = route(message, headers, lane.policy.config, head.rule_for)
    if caller is not True and boundary.scopes_refusal(caller, message, head.rule_for) is not None:
        return None  # the application answers 403, from the same check
    if kind == "owned":
        if way not in ("tasks", "create") or (way == "create") != (head.rule is not None):
            return None
        if way == "create" and message["params"]["name"] != head.tool:
            return None  # the application says how the headers disagree
    elif way != ("as_is" if kind == "as_is" else "relay"):
        return None
    else:
        try:
            if kind == "legacy":
                check_modern_request(message, headers)  # a 2025 server cannot check the 2026 headers itself
                check_reencodable(message, body)  # the bridge encodes it again
            else:
                check_routing_headers(message, headers, required=False)
                if kind == "modern":
                    body = upstream_body(message, body)  # the upstream must not see a tasks declaration
        except JsonRpcError:
            return None
    _, _, query = url.partition(b"?")
    return LaneRequest(
        kind=kind,
        headers=headers,
        body=body,
        message=message,
        fields=tuple(fields),
        query=query,
        rule=head.rule if kind == "owned" else None,
    )
