"""The upstream MCP server as seen from the proxy: raw forwarding for pass-through, and a tool call as events.

A tool call, whatever the upstream answers with (one JSON body or an event stream with progress first), is read
as an async stream of events: Progress, then Finished or Failed. The task runner consumes only these events.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ssl
from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import structlog
from multidict import MultiMapping

from ... import PROTOCOL_VERSION
from ...jsonrpc import METHOD_NOT_FOUND, UNSUPPORTED_PROTOCOL_VERSION, dumps, loads
from ..era2025 import LEGACY_VERSION, proxy_initialize
from ..era2026 import discover_probe, interpret, is_discover_result
from ..events import (
    RETRIED_STATUSES,
    CredentialsNeeded,
    Event,
    Failed,
    NotMcp,
    Progress,
    UpstreamUnavailable,
    proxy_failure,
    retry_after_s,
    too_large,
)
from .client import BodyTooLarge, CallClient, CallError, CallResponse, Unsent
from .headers import own_request_headers
from .sse import SseLimitError, SseParser, iter_events

log = structlog.get_logger(__name__)


class Upstream:
    """The upstream MCP endpoint: the lean client (http/client.py) makes every request to it (task calls,
    pass-through, event streams, 2025 sessions, the era probe); an aiohttp session relays requests to the
    upstream's other paths."""

    def __init__(self, url: str, *, connect_timeout_s: float, tls: ssl.SSLContext | None = None) -> None:
        self.url = url
        self._tls = tls
        parts = urlsplit(url)
        self._origin = urlunsplit((parts.scheme, parts.netloc, "", "", ""))
        self._timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s, sock_connect=connect_timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._calls = CallClient(url, connect_timeout_s=connect_timeout_s, tls=tls)

    async def __aenter__(self) -> Upstream:
        self._session = aiohttp.ClientSession(
            timeout=self._timeout,
            # Pass-through relays bytes as they are: no decompression, and no headers the client did not send.
            auto_decompress=False,
            skip_auto_headers=("Accept-Encoding", "User-Agent"),
            # One TLS context for both clients: upstream.tls (CA bundle, client certificate) or the system's.
            connector=aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True, ssl=self._tls or True),
        )
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._calls.aclose()
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "Upstream used outside its context"
        return self._session

    async def reachable(self, timeout_s: float = 2.0) -> str:
        """ "ok" when the upstream accepts a TCP connection; otherwise why not (for /readyz)."""
        parts = urlsplit(self.url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(parts.hostname, port), timeout_s)
        except (OSError, TimeoutError) as exc:
            return f"upstream unreachable ({type(exc).__name__})"
        writer.close()
        return "ok"

    def target(self, path: str, query_string: str, *, is_mcp_endpoint: bool) -> str:
        base = self.url if is_mcp_endpoint else self._origin + path
        return f"{base}?{query_string}" if query_string else base

    def request(
        self,
        method: str,
        headers: Mapping[str, str] | bytes,
        body: bytes | None,
        *,
        query: str = "",
        relay: bool = False,
    ) -> Awaitable[CallResponse]:
        """One request to the MCP endpoint (POST, GET or DELETE) through the lean client; the caller reads and closes
        the response. CallError (a ConnectionError) when it cannot be made or breaks."""
        return self._calls.request(method, headers, body, query=query, relay=relay)

    async def other_path(
        self, method: str, url: str, headers: Mapping[str, str], body: bytes | None
    ) -> aiohttp.ClientResponse:
        """A request to another path of the upstream's (OAuth metadata and the like), sent as-is through aiohttp's
        client; the caller owns (and must release) the response."""
        try:
            return await self.session.request(method, url, headers=headers, data=body, allow_redirects=False)
        except aiohttp.ClientConnectorError as exc:
            raise ConnectionError(f"cannot connect to {self.url}: {exc.os_error.strerror or exc}") from exc

    def post(
        self, headers: Mapping[str, str] | bytes, body: bytes, *, query: str = "", relay: bool = False
    ) -> Awaitable[CallResponse]:
        """A POST to the MCP endpoint through the lean client; `relay` keeps the response as sent (see http/client.py).

        Not a coroutine of its own on purpose: a frame here would hold `body` for as long as the call waits for its
        answer (the whole run of a working task), where CallClient.post lets go of it once sent.
        """
        return self._calls.post(headers, body, query=query, relay=relay)

    async def probe(self, client_headers: MultiMapping[str]) -> Literal["modern", "legacy"]:
        """The era: a DiscoverResult to server/discover means 2026-07-28; any other answer only an MCP server gives
        (a JSON-RPC message, an MCP session) means 2025. Anything else (a 404, a web page, JSON of another API) may
        still be a 2025 server that answers nothing but initialize, so initialize decides: an MCP answer to it means
        2025, and without one the upstream is no MCP server at this URL (NotMcp, with what each probe got).

        Raises CredentialsNeeded on HTTP 401/403 (the era stays unknown until a client's request carries
        credentials), UpstreamUnavailable while the upstream cannot be reached or does not answer in time."""
        discover = await self._era_answer(discover_probe(), client_headers)
        if is_discover_result(discover.answer):
            return "modern"
        discover.raise_for_credentials()
        if discover.is_mcp:
            return "legacy"
        initialize = await self._era_answer(proxy_initialize(), client_headers)
        initialize.raise_for_credentials()
        if initialize.is_mcp:
            if initialize.session_id is not None:
                await self._end_probe_session(initialize, client_headers)
            return "legacy"
        raise NotMcp(
            f"the upstream answered neither MCP era: server/discover got {discover.describe()}, initialize got "
            f"{initialize.describe()} (is upstream.url's path right?)"
        )

    async def takes_2025_sessions(self, client_headers: MultiMapping[str]) -> bool:
        """Whether a 2026-07-28 server also speaks 2025: false only when it refuses an initialize of the proxy's as
        one that does not do the 2025 handshake (-32022 unsupported version, -32601 no such method); any other
        answer is the server's to give 2025 clients itself. A session the probe opened is ended. Raises
        CredentialsNeeded, UpstreamUnavailable as `probe` does."""
        initialize = await self._era_answer(proxy_initialize(), client_headers)
        initialize.raise_for_credentials()
        if initialize.session_id is not None:
            await self._end_probe_session(initialize, client_headers)
        error = (initialize.answer or {}).get("error")
        if isinstance(error, dict) and error.get("code") in _NO_HANDSHAKE:
            return False
        if initialize.answer is None and (initialize.status >= 500 or initialize.status == 429):
            # Down for a moment (a restart): nothing learnt, the next 2025 request asks again.
            raise UpstreamUnavailable(f"the upstream answered initialize with {initialize.describe()}")
        return True

    async def _era_answer(self, message: dict[str, Any], client_headers: MultiMapping[str]) -> EraAnswer:
        method = message["method"]
        headers = own_request_headers(client_headers, drop_mcp_headers=True)
        if method == "server/discover":
            headers.update({"MCP-Protocol-Version": PROTOCOL_VERSION, "Mcp-Method": method})
        try:
            # Bounded: the probe holds the gateway's era lock, which every request waits on until the era is known.
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                response = await self.request("POST", headers, dumps(message))
                async with response:
                    answer, is_jsonrpc = None, False
                    async with contextlib.aclosing(_messages(response)) as messages:
                        async for each in messages:
                            is_jsonrpc = is_jsonrpc or (isinstance(each, dict) and each.get("jsonrpc") == "2.0")
                            if isinstance(each, dict) and each.get("id") == message["id"]:
                                answer = each
                                break
        except TimeoutError as exc:
            raise UpstreamUnavailable(f"the upstream did not answer {method} within {PROBE_TIMEOUT_S:g} s") from exc
        except OSError as exc:  # CallError included
            raise UpstreamUnavailable(f"upstream unreachable ({exc})") from exc
        return EraAnswer(
            method=method,
            status=response.status,
            content_type=response.content_type,
            is_empty=response.headers.get("content-length", "").strip() == "0",
            location=response.headers.get("location"),
            session_id=response.headers.get("mcp-session-id"),
            answer=answer,
            is_jsonrpc=is_jsonrpc,
        )

    async def _end_probe_session(self, initialize: EraAnswer, client_headers: MultiMapping[str]) -> None:
        """A 2025 server opened a session for the probe's initialize: end it (DELETE), as a client would."""
        assert initialize.session_id is not None
        result = (initialize.answer or {}).get("result")
        version = result.get("protocolVersion") if isinstance(result, dict) else None
        headers = own_request_headers(client_headers, drop_mcp_headers=True)
        headers["Mcp-Session-Id"] = initialize.session_id
        headers["MCP-Protocol-Version"] = str(version or LEGACY_VERSION)
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                await finished(await self.request("DELETE", headers, None))
        except OSError:  # TimeoutError and CallError included
            pass  # the server ends an idle session itself in time

    async def call_tool(
        self,
        message: dict[str, Any],
        client_headers: MultiMapping[str],
        capabilities: dict[str, Any],
        *,
        max_bytes: int,
        caller: str = "",
    ) -> AsyncIterator[Event]:
        """POST one tools/call and yield what happens to it; the last event is Finished or Failed. (`caller`: a
        2026 server over HTTP keeps no session, so every caller's calls go the same way.)

        Closing the generator early closes the upstream response, which is how 2026-07-28 HTTP cancels. A body or
        event longer than `max_bytes` is not read on: the call fails (limits.max_result_bytes).
        """
        try:
            # No local for the headers or the body: this frame waits as long as the call runs.
            response = await self.post(own_request_headers(client_headers), dumps(message))
        except OSError as exc:  # CallError included
            sent = not isinstance(exc, Unsent)
            yield proxy_failure(f"upstream unreachable ({exc})", self.url, transient="unanswered" if sent else "unsent")
            return
        async with response:  # closing an unfinished response closes its connection: the upstream sees the cancel
            async for event in self._read_call(response, message["id"], max_bytes):
                yield event

    async def notify_cancelled(self, request_id: str, client_headers: MultiMapping[str], reason: str) -> None:
        """Tell a legacy session that a call is cancelled: legacy HTTP does not read a dropped stream as one.

        Only calls made inside a legacy Mcp-Session-Id session need this; 2026-07-28 servers cancel on close.
        """
        if "Mcp-Session-Id" not in client_headers:
            return
        headers = own_request_headers(client_headers)
        headers.popall("Mcp-Method", None)
        headers.popall("Mcp-Name", None)
        message = {
            "jsonrpc": "2.0",
            "method": "notifications/cancelled",
            "params": {"requestId": request_id, "reason": reason},
        }
        try:
            await finished(await self.request("POST", headers, dumps(message)))
        except OSError as exc:  # CallError included
            log.warning("upstream_cancel_not_delivered", reason=str(exc))

    async def _read_call(self, response: CallResponse, request_id: Any, max_bytes: int) -> AsyncIterator[Event]:
        content_type = response.content_type
        try:
            if content_type == "text/event-stream":
                async for sse in iter_events(response.iter_chunks(), max_bytes):
                    if not sse.data:
                        continue  # priming events and keep-alives carry nothing
                    event = interpret(_loads(sse.data), request_id, f"HTTP {response.status}", len(sse.data), self.url)
                    if event is not None:
                        yield event
                        if not isinstance(event, Progress):
                            return
                yield proxy_failure("the upstream closed its event stream before answering the call", self.url)
                return
            body = await response.read(max_bytes)
        except (BodyTooLarge, SseLimitError):
            yield too_large(max_bytes)
            return
        except CallError as exc:
            yield proxy_failure(f"the upstream connection broke mid-call ({exc})", self.url)  # after its head
            return
        message = _loads(body) if content_type in ("application/json", "") else None
        event = (
            interpret(message, request_id, f"HTTP {response.status}", len(body), self.url)
            if message is not None
            else None
        )
        if event is None or isinstance(event, Progress):
            detail = f"HTTP {response.status}" + (f" {content_type}" if content_type else "")
            reason = f"the upstream answered {detail} without a JSON-RPC response"
            if response.status in RETRIED_STATUSES:
                after = retry_after_s(response.headers.get("retry-after"))
                event = proxy_failure(reason, self.url, transient="unanswered", retry_after_s=after)
            else:
                event = proxy_failure(reason, self.url)
        if response.status == 401 and isinstance(event, Failed):  # the call's credential, refused: not its work
            event = proxy_failure("the upstream refused the call's credential (HTTP 401)", self.url)
            challenge = response.headers.get("www-authenticate")
            event = dataclasses.replace(event, refused_credentials=True, challenge=challenge)
        yield event


_SHORT_BODY_BYTES = 64 * 1024
_SHORT_BODY_S = 2.0


async def finished(response: CallResponse) -> int:
    """A response whose body nobody needs (a 202 to a notification, a DELETE's answer): read to its end when it
    says it is short (a Content-Length of up to 64 KB, in 2 s), so that its connection is reused; else closed, never
    waited on (a stream that does not end). Its status."""
    async with response:
        length = response.headers.get("content-length", "")
        if length.isdigit() and int(length) <= _SHORT_BODY_BYTES:
            with contextlib.suppress(OSError):  # CallError and TimeoutError included: closed, not pooled
                async with asyncio.timeout(_SHORT_BODY_S):
                    await response.read(_SHORT_BODY_BYTES)
    return response.status


def _loads(data: str | bytes) -> Any:
    try:
        return loads(data)
    except ValueError:
        return None


_NO_HANDSHAKE = (UNSUPPORTED_PROTOCOL_VERSION, METHOD_NOT_FOUND)
"""The errors to initialize of a server that does not do the 2025 handshake."""
HANDSHAKE_MAX_BYTES = 4 * 1024 * 1024
"""The largest answer to a request of the proxy's own (initialize, discover, tools/list, tasks/get) it reads."""
PROBE_TIMEOUT_S = 10.0
"""How long each request of the era probe (server/discover, then maybe initialize) may take."""


@dataclasses.dataclass(frozen=True, slots=True)
class EraAnswer:
    """What the upstream answered one request of the era probe, and whether that answer proves an MCP server."""

    method: str
    status: int
    content_type: str
    is_empty: bool
    location: str | None
    session_id: str | None
    answer: dict[str, Any] | None
    """The JSON-RPC response to the probe's own id, if the body held one."""
    is_jsonrpc: bool
    """The body held a JSON-RPC message (whatever its id: a 2025 server refuses a request without a session with
    an error of id null, or of an id of its own)."""

    @property
    def is_mcp(self) -> bool:
        # A JSON-RPC body or an MCP session: what only an MCP server answers. A 404, a 405 to POST, a redirect, a
        # web page, JSON of another API, an empty 200: what any HTTP server answers at a path that is not MCP.
        return self.is_jsonrpc or self.session_id is not None

    def raise_for_credentials(self) -> None:
        # 401/403, with or without WWW-Authenticate: nothing more can be learnt without credentials, and calling a
        # server that wants them "no MCP server" would take a working deployment out of service.
        if self.status in (401, 403):
            raise CredentialsNeeded(f"the upstream refused {self.method} without credentials (HTTP {self.status})")

    def describe(self) -> str:
        """As a reason names it: "HTTP 404", "HTTP 307 to /mcp/", "HTTP 200 text/html"."""
        if 300 <= self.status < 400 and self.location:
            return f"HTTP {self.status} to {self.location}"
        if self.status >= 300:
            return f"HTTP {self.status}"
        if self.is_empty:
            return f"HTTP {self.status} with an empty body"
        if not self.content_type:
            return f"HTTP {self.status} without a Content-Type"
        if "json" in self.content_type:
            return f"HTTP {self.status} {self.content_type} that is not JSON-RPC"
        return f"HTTP {self.status} {self.content_type}"


async def single_answer(response: CallResponse, request_id: Any) -> dict[str, Any] | None:
    """The response to `request_id` in a body that is JSON or an event stream, read only until that answer (a server
    may keep the stream open after it); None when it has none, or past HANDSHAKE_MAX_BYTES."""
    async with contextlib.aclosing(_messages(response)) as messages:
        async for message in messages:
            if isinstance(message, dict) and message.get("id") == request_id:
                return message
    return None


async def _messages(response: CallResponse) -> AsyncIterator[Any]:
    """Each JSON value of a body that is JSON or an event stream (one per event), as they come; what does not parse
    is skipped. Read no further than HANDSHAKE_MAX_BYTES."""
    try:
        if response.content_type != "text/event-stream":
            message = _loads(await response.read(HANDSHAKE_MAX_BYTES))
            if message is not None:
                yield message
            return
        parser, seen = SseParser(HANDSHAKE_MAX_BYTES), 0
        async for chunk in response.iter_chunks():
            seen += len(chunk)
            if seen > HANDSHAKE_MAX_BYTES:
                raise BodyTooLarge(HANDSHAKE_MAX_BYTES)
            for event in parser.feed(chunk):
                message = _loads(event.data) if event.data else None
                if message is not None:
                    yield message
        for event in parser.feed(b"\n\n"):  # a last event without its blank line
            message = _loads(event.data) if event.data else None
            if message is not None:
                yield message
    except (BodyTooLarge, SseLimitError):
        log.warning("upstream_answer_too_large", limit=HANDSHAKE_MAX_BYTES)
