"""A legacy session's standalone stream (the GET of Streamable HTTP), where a 2025 server may send requests that
belong to no call's own stream: server-everything sends `roots/list` there, and SEP-1686 servers may send a task's
elicitation there.

Each request is tied to the call it belongs to where that can be known (its `related-task` metadata names a task
the proxy follows, or the session has exactly one call in flight) and becomes that call's input round. Any other
request is answered at once with a JSON-RPC error that says why, so no server waits on a client that cannot see it.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import structlog
from multidict import MultiMapping

from ...jsonrpc import INTERNAL_ERROR, error_object
from ..routing import route_for
from .headers import stream_headers
from .sse import SseLimitError, SseParser, StreamPosition

if TYPE_CHECKING:
    from ..era2025 import LegacySession, LegacyUpstream
    from .endpoint import Upstream

log = structlog.get_logger(__name__)

_MAX_EVENT_BYTES = 4 * 1024 * 1024
_READY_WAIT_S = 2.0
"""How long opening a session waits for its standalone stream, so a server request right after is not missed."""
_MAX_RECONNECTS = 5
"""Failed or short-lived connections in a row after which the stream is given up."""
_HEALTHY_STREAM_S = 5.0
_HEADERS_WAIT_S = 30.0
"""How long the server may take to answer the stream's GET with its headers."""
_LOGGED_REFUSALS = 10
"""Refused requests logged one by one per session; past that, one line per thousand (a flood must not flood logs)."""


async def open_stream(
    legacy: LegacyUpstream, upstream: Upstream, session: LegacySession, client_headers: MultiMapping[str]
) -> None:
    """Start reading the session's standalone stream; returns once it is open (or known to be unavailable)."""
    ready = asyncio.Event()
    session.reader = asyncio.ensure_future(_read(legacy, upstream, session, client_headers, ready))
    try:
        await asyncio.wait_for(ready.wait(), timeout=_READY_WAIT_S)
    except TimeoutError:
        log.info("legacy_standalone_stream_slow", wait_s=_READY_WAIT_S)


async def _read(
    legacy: LegacyUpstream,
    upstream: Upstream,
    session: LegacySession,
    client_headers: MultiMapping[str],
    ready: asyncio.Event,
) -> None:
    position = StreamPosition()
    failures = 0
    try:
        while failures <= _MAX_RECONNECTS:
            headers = stream_headers(session, client_headers, position.last_event_id)
            try:
                async with asyncio.timeout(_HEADERS_WAIT_S):  # a server that never answers the GET is a failure
                    response = await upstream.request("GET", headers, None)
            except OSError:  # CallError and TimeoutError included
                ready.set()  # no stream to wait for: the session goes on without one for now
                failures += 1
                await asyncio.sleep(_backoff_s(position.retry_ms, failures))
                continue
            content_type = response.content_type
            if response.status >= 500 or response.status == 429:
                ready.set()
                response.close()  # a passing fault (a gateway's 502, a restart): ask again later
                failures += 1
                await asyncio.sleep(_backoff_s(position.retry_ms, failures))
                continue
            if response.status != 200 or content_type != "text/event-stream":
                # 405: the server offers no standalone stream (allowed); 404: the session is gone, and with it this.
                response.close()
                log.info("legacy_standalone_stream_unavailable", status=response.status)
                return
            ready.set()
            opened_s = time.monotonic()
            parser = SseParser(_MAX_EVENT_BYTES)
            try:
                async for chunk in response.iter_chunks():
                    for message in position.messages(parser, chunk):
                        await _on_message(legacy, session, client_headers, message)
            except (OSError, SseLimitError) as exc:  # CallError included
                log.info("legacy_standalone_stream_broken", reason=str(exc) or type(exc).__name__)
            except Exception:
                # A fault of the proxy's own on a hostile stream must not end the reader silently.
                log.exception("legacy_standalone_stream_error")
                failures += 1
            finally:
                response.close()
            # A stream that lived a while was closed on purpose (an idle timeout of a load balancer): open it again.
            failures = 0 if time.monotonic() - opened_s >= _HEALTHY_STREAM_S else failures + 1
            await asyncio.sleep(_backoff_s(position.retry_ms, failures))
        log.warning("legacy_standalone_stream_given_up", failures=failures)
    finally:
        ready.set()


def _backoff_s(retry_ms: int, failures: int) -> float:
    """The server's retry delay (at least 100 ms), doubled for each failure in a row, at most 30 s."""
    return min(max(retry_ms, 100) / 1000 * 2 ** max(failures - 1, 0), 30.0)


async def _on_message(
    legacy: LegacyUpstream, session: LegacySession, client_headers: MultiMapping[str], message: dict[str, Any]
) -> None:
    method = message.get("method")
    if not isinstance(method, str) or "id" not in message:
        return  # notifications and stray responses: nothing of the proxy's own sessions waits on them
    if method == "ping":
        await legacy.respond(session, client_headers, message["id"], {"result": {}})
        return
    route, why = route_for(session.calls, message)
    if route is not None and route.on_request is None:
        route, why = None, "its call cannot take input from outside its own stream"
    if route is None:
        session.refused += 1
        if session.refused <= _LOGGED_REFUSALS or session.refused % 1000 == 0:
            log.info("legacy_standalone_request_refused", upstream_method=method, reason=why, count=session.refused)
        error = error_object(INTERNAL_ERROR, f"The proxy cannot relay this {method} request: {why}")
        await legacy.respond(session, client_headers, message["id"], {"error": error})
        return
    needed = await legacy.server_request(session, client_headers, message, route.capabilities)
    if needed is not None:
        assert route.on_request is not None
        legacy.spawn(route.on_request(needed))  # the reader goes on: the answer may take the user minutes
