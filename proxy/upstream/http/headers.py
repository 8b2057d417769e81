"""Which request and response headers an intermediary passes on (RFC 9110), and those of the proxy's own POSTs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from multidict import CIMultiDict, MultiMapping

from ... import tracing
from ...jsonrpc import INVALID_REQUEST, JsonRpcError

if TYPE_CHECKING:
    from ..routing import LegacySession

# RFC 9110 §7.6.1 hop-by-hop fields, plus those the proxy recomputes for the body it sends.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
HOP_HEADER = "Mcp-Tasks-Proxy-Hop"
"""A request one replica forwards to another (proxy/front/session_routing.py): signed, never passed upstream."""
_REQUEST_SKIP = HOP_BY_HOP | {"host", "content-length", HOP_HEADER.lower()}
RESPONSE_SKIP = HOP_BY_HOP | {"content-length"}
TASK_CALL_SKIP = _REQUEST_SKIP | {"accept-encoding", "accept", "content-type", "last-event-id"}
_REQUEST_SKIP_BYTES = frozenset(name.encode() for name in _REQUEST_SKIP)
_REQUEST_SKIP_TRACED_BYTES = _REQUEST_SKIP_BYTES | {b"traceparent", b"tracestate"}
"""With tracing on, the client's trace context goes no further: the proxy's span is the upstream's parent."""


def connection_listed(value: str | None) -> set[str]:
    """The header names a Connection field value lists (lowercase): hop-by-hop for this connection only."""
    if not value:
        return set()
    return {token.strip().lower() for token in value.split(",") if token.strip()}


def end_to_end_headers(
    headers: MultiMapping[str], skip: frozenset[str] | set[str], *, drop_prefix: str | None = None
) -> CIMultiDict[str]:
    """Copy the headers an intermediary must pass on: all but hop-by-hop ones and those named in Connection (and,
    with `drop_prefix`, those whose lowercase name starts with it)."""
    drop = skip.union(*(connection_listed(value) for value in headers.getall("Connection", ())))
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        lower = name.lower()
        if lower not in drop and not (drop_prefix is not None and lower.startswith(drop_prefix)):
            out.add(name, value)
    return out


MAX_KEPT_HEADER_BYTES = 32 * 1024
"""The most of a request's headers (names and values) a task keeps for its upstream calls: as much as the lane
reads of a whole request head. aiohttp reads heads of up to about 1 MB, and a working task would keep all of it."""


def call_headers(headers: MultiMapping[str], keep: str | None = None) -> CIMultiDict[str]:
    """The client's headers a task keeps for the upstream requests it makes later: what own_request_headers passes
    on, and `keep` (the header that names the caller, whichever it is). No more: ten thousand working tasks each
    hold theirs for as long as they run; past MAX_KEPT_HEADER_BYTES the request is refused (-32600)."""
    skip = TASK_CALL_SKIP if keep is None else TASK_CALL_SKIP - {keep.lower()}
    kept = end_to_end_headers(headers, skip)
    size = sum(len(name) + len(value) for name, value in kept.items())
    if size > MAX_KEPT_HEADER_BYTES:
        raise JsonRpcError(
            INVALID_REQUEST,
            f"Invalid request: a task keeps the request's headers for its upstream calls, at most "
            f"{MAX_KEPT_HEADER_BYTES} bytes of them, and these are {size}",
        )
    return kept


def request_headers(headers: MultiMapping[str]) -> CIMultiDict[str]:
    out = end_to_end_headers(headers, _REQUEST_SKIP)
    if tracing.TRACER.enabled:
        tracing.TRACER.inject(out)  # the proxy's span is the upstream's parent, not the client's
    return out


def relayed_request_fields(raw_headers: tuple[tuple[bytes, bytes], ...], headers: MultiMapping[str]) -> bytes:
    """A relayed request's end-to-end header lines for the upstream, serialized from the bytes as received (the
    pass-through path: nothing decoded, nothing re-encoded), with tracing on the proxy's trace context in place of
    the client's. `headers` is the same request's decoded view."""
    # With a span current, the proxy's trace fields replace the client's; else the client's go as received.
    context = tracing.TRACER.trace_fields() if tracing.TRACER.enabled else None  # type: ignore[union-attr]
    drop = _REQUEST_SKIP_BYTES if context is None else _REQUEST_SKIP_TRACED_BYTES
    if "Connection" in headers:  # rare: headers named hop-by-hop for this connection only go no further either
        listed = connection_listed(", ".join(headers.getall("Connection")))
        drop = drop.union(name.encode("utf-8", "surrogateescape") for name in listed)
    lines = [b"%s: %s\r\n" % field for field in raw_headers if field[0].lower() not in drop]
    fields = b"".join(lines)
    # The parser refuses CR and LF inside a field; never trusted alone, as one would end the line early upstream.
    if fields.count(b"\n") != len(lines) or fields.count(b"\r") != len(lines):
        raise ValueError("a header holds CR or LF and cannot be sent")
    if b" \r\n" in fields or b"\t\r\n" in fields:
        # llhttp keeps a value's trailing spaces and tabs, aiohttp strips them: the upstream gets the same bytes
        # whichever path relayed the request. Two searches of the whole block, not a strip per field.
        stripped = ((name, value.rstrip(b" \t")) for name, value in raw_headers if name.lower() not in drop)
        fields = b"".join(b"%s: %s\r\n" % field for field in stripped)
    if context is not None:
        fields += b"".join(b"%s: %s\r\n" % (name.encode(), value.encode()) for name, value in context.items())
    return fields


def response_headers(headers: MultiMapping[str]) -> CIMultiDict[str]:
    return end_to_end_headers(headers, RESPONSE_SKIP)


_JSON_POST = (("Content-Type", "application/json"), ("Accept", "application/json, text/event-stream"))
"""What the proxy's own JSON-RPC POSTs say of their body and of the answer they take."""


def own_request_headers(client_headers: MultiMapping[str], *, drop_mcp_headers: bool = False) -> CIMultiDict[str]:
    """Headers for a JSON-RPC POST the proxy makes for a client: the client's end-to-end headers (credentials
    included), JSON in, JSON or an event stream out. `drop_mcp_headers` removes every Mcp-* header (MCP-Protocol-
    Version included), for requests whose routing headers the proxy sets itself."""
    headers = end_to_end_headers(client_headers, TASK_CALL_SKIP, drop_prefix="mcp-" if drop_mcp_headers else None)
    headers.extend(_JSON_POST)  # both names are in TASK_CALL_SKIP: never the client's
    if tracing.TRACER.enabled:
        tracing.TRACER.inject(headers)
    return headers


def _session_fields(session: LegacySession, client_headers: MultiMapping[str]) -> list[tuple[str, str]]:
    """A POST's fields on a 2025-era session, without tracing's: the client's end-to-end ones but for every Mcp-*
    (Mcp-Method, Mcp-Name, Mcp-Param-* are not defined before 2026-07-28), then JSON, the session's version and id."""
    drop = TASK_CALL_SKIP
    if "Connection" in client_headers:
        drop = drop.union(*(connection_listed(value) for value in client_headers.getall("Connection")))
    fields = [
        (name, value)
        for name, value in client_headers.items()
        if (lower := name.lower()) not in drop and not lower.startswith("mcp-")
    ]
    fields += _JSON_POST
    fields.append(("MCP-Protocol-Version", session.protocol_version))
    if session.session_id is not None:
        fields.append(("Mcp-Session-Id", session.session_id))
    return fields


def session_headers(session: LegacySession, client_headers: MultiMapping[str]) -> CIMultiDict[str]:
    headers = CIMultiDict(_session_fields(session, client_headers))
    if tracing.TRACER.enabled:
        tracing.TRACER.inject(headers)
    return headers


def session_post_fields(session: LegacySession, client_headers: MultiMapping[str]) -> bytes | CIMultiDict[str]:
    """`session_headers` as the lean client sends them, serialized in one pass (a bridged call's POST: no mapping
    made and walked again); the mapping itself when tracing adds its own header. ValueError for a field that cannot
    be sent (CR, LF, a colon in a name)."""
    if tracing.TRACER.enabled:
        return session_headers(session, client_headers)
    fields = _session_fields(session, client_headers)
    block = "".join([f"{name}: {value}\r\n" for name, value in fields])
    # Two counts over the block, not four searches a field (the lean client's check of a mapping).
    if block.count("\n") != len(fields) or block.count("\r") != len(fields):
        raise ValueError("a header holds CR or LF and cannot be sent")
    for name, _ in fields:
        if ":" in name:
            raise ValueError(f"header {name!r} cannot be sent")
    return block.encode("utf-8", "surrogateescape")


def stream_headers(
    session: LegacySession, client_headers: MultiMapping[str], last_event_id: str | None
) -> CIMultiDict[str]:
    """A GET for the session's event stream: the standalone one, or a call's resumed after `last_event_id`."""
    headers = session_headers(session, client_headers)
    headers.popall("Content-Type", None)
    headers["Accept"] = "text/event-stream"
    if last_event_id is not None:
        headers["Last-Event-ID"] = last_event_id
    return headers
