"""The pass-through lane: a 2026-07-28 request the proxy does not own, relayed on the raw client connection.

aiohttp's server machinery (request and response objects, payload writer, handler task) costs more CPU per request
than a bare forwarder's whole hop (bench/ab.py), and a request the proxy only relays needs none of it. So every
client connection starts here, parsed by httptools (llhttp, as the lean client's responses are). A POST to the MCP
endpoint whose body says, and whose headers agree, that it is a 2026 request for a 2026 upstream (not tasks/*, no
tasks declaration, no rule for its tool, not listen or discover: `dispatch.relayed_as_is`) is posted upstream with
the lean client and its answer written back as the upstream sent it. Anything else, and anything the proxy would
refuse or answer itself (a bad header, Host or Origin, a body too large, JSON that does not parse), hands the
connection, with the bytes of that request, to aiohttp, which answers it as it always did and keeps the connection.

What a relayed request still gets here: the Host/Origin guard, the size and time bounds of `listen` and `limits`,
the request's metrics and log line, cancellation upstream when the client leaves, and a JSON-RPC error when the
upstream cannot be reached or breaks an event stream before the answer. With tracing on, or with replicas routing
sessions (`listen.advertise_url`), or in front of a stdio or 2025-era upstream, every request goes to aiohttp.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable
from email.utils import formatdate
from http import HTTPStatus
from typing import Any

import httptools
import structlog
from aiohttp import web
from aiohttp.http import SERVER_SOFTWARE
from aiohttp.http_parser import SINGLETON_HEADERS
from multidict import CIMultiDict

from . import tracing
from .config import TaskMode
from .context import MCP_PATH, bridge_key, gateway_key, guard_key, identity_key, metrics_key, policy_key
from .dispatch import relayed_as_is
from .envelope import check_modern_request, check_routing_headers, decode_header_value
from .jsonrpc import (
    INTERNAL_ERROR,
    INVALID_REQUEST,
    JsonRpcError,
    UpstreamError,
    dumps,
    error_object,
    error_response,
    loads,
)
from .log import bind_request_id
from .metrics import method_label
from .upstream.http.client import CallError, CallResponse
from .upstream.http.headers import relayed_request_fields
from .upstream.http.relay import READ_WHOLE_BYTES, STREAM_TYPES, AnswerWatcher, HttpRelay, broken_stream_event
from .visits import Visit

log = structlog.get_logger(__name__)

MAX_HEAD_BYTES = 32 * 1024
"""A longer head is aiohttp's to refuse (its limits are lower): the lane never buffers more of one."""
_MAX_PENDING_BYTES = 64 * 1024
"""Bytes a client may send ahead of an answer still owed before the lane stops reading its connection."""
_VERBOSE_LEVELS = frozenset({"debug", "info"})
_MCP_PATH = MCP_PATH.encode()
_OWNED_METHODS = frozenset({"subscriptions/listen", "server/discover"})
_SWEEP_S = 0.25
_SINGLETONS = frozenset(name.lower().encode() for name in SINGLETON_HEADERS)
_VISITS_IN_A_ROW = 8
"""Requests in a row that aiohttp answers on a lane connection before it is handed the connection for good."""
_MAX_FIELDS = 100
_MAX_FIELD_BYTES = 8190
"""aiohttp's server refuses longer lines and more fields: the lane hands such requests over rather than relay what
aiohttp would refuse."""
_NEVER = float("inf")


class _HandOver(Exception):
    """This request is aiohttp's: raised out of a parser callback to stop parsing there."""


class _Pipelined(Exception):
    """A second request arrived in the same read as the end of one the lane relays."""


class _Probe:
    """Counts the requests a parser saw complete (_LaneConnection._split_pipelined)."""

    complete = 0

    def on_message_complete(self) -> None:
        self.complete += 1


class Lane:
    """The protocol factory of the listening socket: a `_LaneConnection` per client connection, each handed to
    `handlers` (aiohttp's web.Server) when it carries a request the lane does not relay."""

    def __init__(self, app: web.Application, handlers: web.Server, *, header_timeout_s: float) -> None:
        """`app` has started: what each request needs of it is looked up once, here (the policy's config is read
        at every request, as a reload replaces it)."""
        self._handlers = handlers
        self.header_timeout_s = header_timeout_s
        self.connections: set[_LaneConnection] = set()
        self.admit: Callable[[asyncio.Transport], bool] = lambda transport: True
        """The connection cap (proxy/serve.py): False when this connection was refused and closed."""
        self.policy = app[policy_key]
        self.gateway = app[gateway_key]
        self.guard = app[guard_key]
        self.metrics = app[metrics_key]
        self.identity = app[identity_key]
        self.bridge = app[bridge_key]
        self.loop = asyncio.get_running_loop()
        self._date = ("", 0)
        self._sweep: asyncio.TimerHandle | None = None
        self.counts = {"relayed": 0, "visited": 0, "handed_over": 0}
        """Requests the lane relayed, requests aiohttp answered on the lane's connection (proxy/visits.py), and
        connections handed to aiohttp for good (mcp_tasks_proxy_lane_total)."""
        self.visitors = 0
        self.own = False
        """Set while aiohttp is given a connection the lane admitted already (proxy/serve.py's cap skips it)."""
        """Lane connections with an aiohttp handler of their own: both count them, the connection cap once."""
        self.metrics.watch("mcp_tasks_proxy_lane", "Requests the pass-through lane relayed without aiohttp "
                           "(relayed), requests aiohttp answered on its connections (visited), and connections it "
                           "handed to aiohttp (handed_over)", "outcome",
                           lambda: self.counts, counter=True)  # fmt: skip

    def __call__(self) -> _LaneConnection:
        if self._sweep is None:
            self._sweep = self.loop.call_later(_SWEEP_S, self._expire)
        return _LaneConnection(self)

    def route(self) -> str | None:
        """How a request may be relayed here now: "modern" (to a 2026 HTTP upstream, as received), "legacy"
        (bridged to a 2025-era one, over either transport), or None: every request is aiohttp's."""
        if tracing.TRACER.enabled or self.policy.config.listen.advertise_url is not None:
            return None
        era = self.gateway.known_era
        if era == "modern":
            return era if isinstance(self.gateway.relay, HttpRelay) else None
        return era

    def _expire(self) -> None:
        """One timer for every connection's head and body deadlines: a timer per request costs more than the
        sweep, and a deadline met a fraction of a second late changes nothing."""
        now = self.loop.time()
        for connection in [c for c in self.connections if c.deadline <= now]:
            connection.expired()
        self._sweep = self.loop.call_later(_SWEEP_S, self._expire)

    def hand_over(self, connection: _LaneConnection, transport: asyncio.Transport, data: bytes) -> None:
        """Give the connection, and the bytes of the request it is reading, to aiohttp."""
        self.connections.discard(connection)
        self.counts["handed_over"] += 1
        self.own = True  # an admitted connection changing hands: the cap does not judge it again
        try:
            handler = self._handlers()
            handler.connection_made(transport)
        finally:
            self.own = False
        transport.set_protocol(handler)
        if data:
            handler.data_received(data)

    def date(self) -> str:
        now = int(time.time())
        if self._date[1] != now:
            self._date = (formatdate(now, usegmt=True), now)
        return self._date[0]

    async def shutdown(self, timeout_s: float) -> None:
        """Stop: idle connections close now, answers still owed get up to `timeout_s`."""
        if self._sweep is not None:
            self._sweep.cancel()
        for connection in list(self.connections):
            connection.close_when_idle()
        running = [c.running for c in self.connections if c.running is not None]
        if running:
            await asyncio.wait(running, timeout=timeout_s)
        for connection in list(self.connections):
            if not connection.visiting:  # aiohttp's shutdown, next, gives its answers their time
                connection.abort()


class _LaneConnection(asyncio.Protocol):
    """One client connection while the lane has it: requests parsed, relayed ones answered in order."""

    def __init__(self, lane: Lane) -> None:
        self._lane = lane
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._raw = bytearray()  # the bytes of the request being read, for aiohttp should it be handed over
        self._url = b""
        self._fields: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._head_bytes = 0
        self._reading = "head"  # head | body | answering
        self.deadline = lane.loop.time() + lane.header_timeout_s
        """When the head (or, once it is in, the body) being read is late."""
        self._pending = bytearray()  # bytes received while an answer is owed
        self._closing = False
        self._write_paused: asyncio.Future[None] | None = None
        self.running: asyncio.Task[None] | None = None
        self._head_sent = False  # of the answer being written
        self._route: str | None = None  # Lane.route() when this request's head came in
        self._for_aiohttp = False  # the request being read is aiohttp's to answer (a visit)
        self._visit_due = False  # ... and it has been read whole
        self._visit: Visit | None = None
        self.visiting = False  # aiohttp's answer to a visit is under way
        self._visits_in_a_row = 0
        self._pipelined = False  # a second request began in the read that ended this one

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        self._lane.connections.add(self)
        if not self._lane.admit(self._transport):  # type: ignore[arg-type]
            self._lane.connections.discard(self)

    def data_received(self, data: bytes) -> None:
        if self.running is not None or self.visiting:  # an answer is owed: what comes next waits for it
            self._pending += data
            if len(self._pending) > _MAX_PENDING_BYTES and self._transport is not None:
                self._transport.pause_reading()
            return
        self._feed(data)

    def eof_received(self) -> bool:
        return False  # closes the transport; a call in flight is cancelled by connection_lost

    def connection_lost(self, exc: Exception | None) -> None:
        self._lane.connections.discard(self)
        if self._visit is not None:
            self._drop_visit(exc, now=True)  # aiohttp's handler learns the client left (and cancels what it runs)
        if self.running is not None:
            self.running.cancel()  # the client left: the upstream call is closed, as aiohttp's handler_cancellation
        if self._write_paused is not None and not self._write_paused.done():
            self._write_paused.set_exception(ConnectionResetError("the client closed the connection"))
        self._transport = None

    def pause_writing(self) -> None:
        if self.visiting and self._visit is not None:
            self._visit.handler.pause_writing()
        if self._write_paused is None or self._write_paused.done():
            self._write_paused = self._lane.loop.create_future()

    def resume_writing(self) -> None:
        if self._visit is not None:
            self._visit.handler.resume_writing()
        if self._write_paused is not None and not self._write_paused.done():
            self._write_paused.set_result(None)

    # parsing

    def _feed(self, data: bytes) -> None:
        self._raw += data
        if self._reading == "head":
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._hand_over()
                return
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            rest = self._split_pipelined() if self._pipelined else None
            self._pipelined = False
            if rest is not None:
                # Pipelined requests wait, in order, for the answer to this one.
                self._pending[:0] = rest
                self._parser = httptools.HttpRequestParser(self)
            elif self.running is not None:
                # What followed a relayed request cannot be told apart from it: the answer, then the end.
                self._closing = True
            else:
                # A request aiohttp must see as it came (or pipelined ones, or bytes only aiohttp will judge).
                self._hand_over()
                return
        if self.running is not None:
            self._raw = bytearray()
        elif self._visit_due:
            self._visit_due = False
            self._start_visit()

    def _split_pipelined(self) -> bytes | None:
        """The bytes after the request just read, when a second one began in the same read: its head ends at the
        first blank line and its body has the Content-Length the lane required, checked by parsing it again.
        None when that does not hold."""
        raw = self._raw
        head_end = raw.find(b"\r\n\r\n")
        if head_end < 0:
            return None
        lengths = [value for name, value in self._fields if name.lower() == b"content-length"]
        end = head_end + 4 + (int(lengths[0]) if lengths else 0)
        probe = _Probe()
        try:
            httptools.HttpRequestParser(probe).feed_data(bytes(raw[:end]))
        except (httptools.HttpParserError, httptools.HttpParserUpgrade, ValueError):
            return None
        if probe.complete != 1:
            return None
        rest = bytes(raw[end:])
        del raw[end:]
        return rest

    def on_message_begin(self) -> None:
        if self.running is not None or self._visit_due:
            self._pipelined = True
            raise _Pipelined  # parsed after this request's answer, from _pending
        self._url = b""
        self._fields = []
        self._body = []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._fields.append((name, value))

    def on_headers_complete(self) -> None:
        if not self._relayable_head():
            if not self._visitable_head():
                raise _HandOver
            self._for_aiohttp = True
        self._reading = "body"
        self.deadline = self._lane.loop.time() + self._lane.policy.config.listen.body_timeout_s

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        request = None if self._for_aiohttp else self._relayable_request()
        if request is None:
            self._visit_due = True  # once the parser has returned: anything after it in this read is pipelined
            return
        self._head_sent = False
        self._reading = "answering"
        self.deadline = _NEVER  # the client's own wait: as long as the upstream call takes
        self._lane.counts["relayed"] += 1
        self._visits_in_a_row = 0
        keep_alive = self._parser.should_keep_alive()
        self.running = self._lane.loop.create_task(self._answer(*request, keep_alive=keep_alive))

    def _relayable_head(self) -> bool:
        """Whether the head alone leaves this request possibly the lane's (the body decides: `_relayable_request`)."""
        parser = self._parser
        if parser.get_method() != b"POST" or parser.get_http_version() != "1.1":
            return False
        self._route = self._lane.route()
        if self._route is None:
            return False
        path, _, _ = self._url.partition(b"?")
        if path != _MCP_PATH or len(self._url) > _MAX_FIELD_BYTES or len(self._fields) > _MAX_FIELDS:
            return False  # past aiohttp's own limits: it refuses such a request, and so it must see it
        length = method = name = None
        seen: set[bytes] = set()
        for field, value in self._fields:
            if not value.isascii() or len(value) > _MAX_FIELD_BYTES:
                return False  # what the proxy says of a header that is not UTF-8 is aiohttp's to say
            lower = field.lower()
            if lower in _SINGLETONS:
                if lower in seen:
                    return False  # aiohttp refuses a repeated Host, Content-Type...: it must see the request
                seen.add(lower)
            if lower == b"content-length":
                if length is not None:
                    return False
                length = value
            elif lower in (b"transfer-encoding", b"expect", b"upgrade"):
                return False
            elif lower == b"mcp-method":
                method = value.decode().strip()
            elif lower == b"mcp-name":
                name = value
        if length is None or method is None or method.startswith("tasks/") or method in _OWNED_METHODS:
            return False
        if method == "tools/call" and name is not None:
            # A tool the policy runs as a task is the proxy's: no need to read its body to know (it is checked
            # against the header all the same, by aiohttp's path).
            tool = decode_header_value(name.decode())
            rule = self._lane.policy.config.rule_for(tool) if tool is not None else None
            if rule is not None and rule.task is not TaskMode.NEVER:
                return False
        try:
            return 0 < int(length) <= self._lane.policy.config.limits.max_body_bytes
        except ValueError:
            return False

    def _visitable_head(self) -> bool:
        """Whether aiohttp may answer this request on the lane's connection: a whole request in bounded bytes,
        answered with a body the lane can frame (not HEAD), nothing that changes the connection."""
        parser = self._parser
        if parser.get_http_version() != "1.1" or parser.get_method() in (b"HEAD", b"CONNECT"):
            return False
        if len(self._url) > _MAX_FIELD_BYTES or len(self._fields) > _MAX_FIELDS:
            return False
        for name, value in self._fields:
            lower = name.lower()
            if lower in (b"transfer-encoding", b"expect", b"upgrade"):
                return False
            if lower == b"content-length":
                try:
                    if int(value) > self._lane.policy.config.limits.max_body_bytes:
                        return False
                except ValueError:
                    return False
        return True

    def _relayable_request(self) -> tuple[CIMultiDict[str], bytes, dict[str, Any]] | None:
        headers = CIMultiDict([(name.decode(), value.decode()) for name, value in self._fields])
        guard = self._lane.guard
        if not guard.host_allowed(headers.get("Host")) or not guard.origin_allowed(headers.get("Origin")):
            return None
        body = b"".join(self._body)
        try:
            message = loads(body)
        except ValueError:
            return None
        if not relayed_as_is(message, headers, self._lane.policy.config.rule_for):
            return None
        try:
            if self._route == "legacy":
                check_modern_request(message, headers)  # a 2025 server cannot check the 2026 headers itself
            else:
                check_routing_headers(message, headers, required=False)
        except JsonRpcError:
            return None
        return headers, body, message

    def _hand_over(self) -> None:
        self.deadline = _NEVER
        self._visit_due = False
        if self._visit is not None:
            self._drop_visit(None, now=True)  # before the new handler: the cap counts the connection once
        transport, self._transport = self._transport, None
        if transport is None or transport.is_closing():
            return
        self._parser = None  # type: ignore[assignment]  # no cycle back to this protocol
        self._lane.hand_over(self, transport, bytes(self._raw))

    # visits (proxy/visits.py)

    def _start_visit(self) -> None:
        transport = self._transport
        if transport is None:
            return
        self._visits_in_a_row += 1
        if self._visits_in_a_row > _VISITS_IN_A_ROW:
            # A connection of the proxy's own requests (a client creating and polling tasks): the lane's parse only
            # adds to aiohttp's, so aiohttp reads it from here on (measured: bench/ab.py --path create).
            self._hand_over()
            return
        if self._visit is None:
            lane = self._lane
            lane.visitors += 1
            lane.own = True  # an admitted connection: the cap does not judge it again
            try:
                self._visit = Visit(
                    transport, lane._handlers, on_answered=self._visit_answered, on_close=self._visit_closed
                )
            finally:
                lane.own = False
        self._lane.counts["visited"] += 1
        self.visiting, self._for_aiohttp = True, False
        self._reading, self.deadline = "answering", _NEVER
        raw, self._raw = bytes(self._raw), bytearray()
        self._visit.request(raw)

    def _visit_answered(self, keep_alive: bool) -> None:
        if not self.visiting:
            return
        self.visiting = False
        self._answered(keep_alive)

    def _visit_closed(self) -> None:
        """aiohttp closes its transport: mid-answer (an error, Connection: close, its shutdown) that ends the
        client's connection; between requests (its keep-alive timer) only its handler ends."""
        if self.visiting or (self._visit is not None and self._visit.answering):
            self.visiting = False
            self.abort()
        elif self._visit is not None:
            self._drop_visit(None)

    def _drop_visit(self, exc: Exception | None, *, now: bool = False) -> None:
        """End aiohttp's handler for this connection; `now` unless aiohttp itself is closing it (no re-entry)."""
        visit, self._visit = self._visit, None
        if visit is None:
            return
        self._lane.visitors -= 1
        if now:
            visit.handler.connection_lost(exc)
        else:
            self._lane.loop.call_soon(visit.handler.connection_lost, exc)

    # deadlines

    def expired(self) -> None:
        """The head or body being read is late (Lane._expire): a late head closes the connection, as aiohttp's
        keep-alive timer does; a late body gets 408, as proxy/dispatch.py's read does."""
        self.deadline = _NEVER
        if self._reading == "body" and self._transport is not None:
            body_timeout_s = self._lane.policy.config.listen.body_timeout_s
            reason = f"Request body not received within {body_timeout_s:g} s (listen.body_timeout_s)"
            self._write_error(None, error_object(INVALID_REQUEST, reason), 408, keep_alive=False)
            self._lane.metrics.observe_request("none", "local", 408, body_timeout_s)
        self.abort()

    # answering

    async def _answer(
        self, headers: CIMultiDict[str], body: bytes, message: dict[str, Any], *, keep_alive: bool
    ) -> None:
        lane = self._lane
        client_id = headers.get("X-Request-Id")
        usable = client_id is not None and 0 < len(client_id) <= 128 and client_id.isprintable()
        bind_request_id(client_id if usable else None)
        started = time.perf_counter()
        method = message["method"]
        legacy = self._route == "legacy"
        status, mode = 500, "legacy" if legacy else "passthrough"
        try:
            if legacy:
                status = await lane.bridge.relay(headers, message, _LaneReply(self, keep_alive))
            else:
                status = await self._relay(headers, body, message, keep_alive=keep_alive)
        except asyncio.CancelledError:
            status = 499
            raise
        except (UpstreamError, JsonRpcError) as exc:  # raised before anything was written
            if isinstance(exc, UpstreamError):
                log.warning("upstream_error", reason=exc.reason)
                lane.metrics.upstream_errors.labels("request").inc()
            status, mode = exc.http_status, "legacy" if legacy else "local"
            self._write_error(message["id"], exc.to_error(), status, keep_alive=keep_alive)
        except Exception as exc:  # the boundary: no client sees a traceback
            if isinstance(exc, ConnectionResetError) and self._transport is None:
                status = 499
            elif self._head_sent:
                log.exception("unhandled_error", exc_info=exc)
                self.abort()  # mid-answer: the client sees it broken, never a second head
                keep_alive = False
            else:
                log.exception("unhandled_error", exc_info=exc)
                status, mode = 200, "local"
                error = error_object(INTERNAL_ERROR, "Internal error in the proxy")
                self._write_error(message["id"], error, status, keep_alive=False)
                keep_alive = False
        finally:
            elapsed_s = time.perf_counter() - started
            lane.metrics.observe_request(method_label(method), mode, status, elapsed_s)
            if lane.policy.config.logging.level in _VERBOSE_LEVELS:
                params = message.get("params")
                tool = params.get("name") if method == "tools/call" and isinstance(params, dict) else None
                log.info(
                    "request_handled",
                    principal=lane.identity.logged_principal(headers),
                    http_method="POST",
                    path=MCP_PATH,
                    method=method,
                    tool=tool if isinstance(tool, str) else None,
                    task_id=None,
                    mode=mode,
                    status=status,
                    client_closed=status == 499,
                    duration_ms=round(elapsed_s * 1000, 2),
                )
        self.running = None
        self._answered(keep_alive)

    async def _relay(self, headers: CIMultiDict[str], body: bytes, message: dict[str, Any], *, keep_alive: bool) -> int:
        upstream = self._lane.gateway.relay.upstream  # type: ignore[attr-defined]  # an HttpRelay: Lane.open
        _, _, query = self._url.partition(b"?")
        try:
            fields = relayed_request_fields(tuple(self._fields), headers)
            response = await upstream.post(fields, body, query=query.decode(), relay=True)
        except (OSError, ValueError) as exc:  # CallError included; ValueError: a header that cannot be sent
            raise UpstreamError(f"upstream unreachable ({exc})", upstream=upstream.url) from exc
        del body
        with contextlib.closing(response):  # pooled when read to its end, else closed: the upstream sees a cancel
            status = response.status
            stream = response.content_type in STREAM_TYPES
            length = response.headers.get("content-length")  # the parser refused a malformed one
            empty = status in (204, 304)
            if not empty and (stream or length is None or int(length) > READ_WHOLE_BYTES):
                whole = None if stream or length is None else int(length)
                await self._relay_stream(response, whole, message["id"], keep_alive=keep_alive)
                return status
            try:
                payload = await response.read() if not empty else b""
            except CallError as exc:
                raise UpstreamError(
                    f"the upstream connection broke mid-response ({exc})", upstream=upstream.url
                ) from exc
            self._write(self._head(response, keep_alive, None if empty else len(payload)) + payload)
            return status

    async def _relay_stream(
        self, response: CallResponse, length: int | None, request_id: Any, *, keep_alive: bool
    ) -> None:
        """Each chunk as it arrives (a stream is never buffered to its end), chunked unless a length is known."""
        chunked = length is None
        self._write(self._head(response, keep_alive, length))
        watcher = AnswerWatcher(request_id) if response.content_type in STREAM_TYPES else None
        upstream_url = self._lane.gateway.url
        chunks = response.iter_chunks()
        while True:
            try:
                chunk = await anext(chunks, b"")
            except (OSError, CallError) as exc:
                log.warning("upstream_stream_broken", reason=str(exc) or type(exc).__name__)
                if watcher is not None and not watcher.answered:
                    event = broken_stream_event(request_id, upstream_url)
                    self._write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(event), event))
                    return
                self._closing = True  # the client sees a broken response, as the proxy did
                self.abort()
                return
            if not chunk:
                break
            if watcher is not None:
                watcher.feed(chunk)
            self._write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
            await self._drain()
        if chunked:
            self._write(b"0\r\n\r\n")

    def _head(self, response: CallResponse, keep_alive: bool, length: int | None) -> bytes:
        """The upstream's status line and end-to-end fields as received, framed for this connection."""
        relayed = response.relayed_headers
        assert relayed is not None
        status = response.status
        lines = [b"HTTP/1.1 %d %s\r\n" % (status, response.reason.encode("latin-1"))]
        # Decoded as latin-1 by the lean client: encoded back the same way, byte for byte.
        lines.extend(f"{name}: {value}\r\n".encode("latin-1") for name, value in relayed.items())
        if "Date" not in relayed:
            lines.append(f"Date: {self._lane.date()}\r\n".encode())
        if "Server" not in relayed:
            lines.append(_SERVER)
        if length is not None:
            lines.append(b"Content-Length: %d\r\n" % length)
        elif status not in (204, 304):
            lines.append(b"Transfer-Encoding: chunked\r\n")
        if not keep_alive or self._closing:
            lines.append(b"Connection: close\r\n")
        lines.append(b"\r\n")
        return b"".join(lines)

    def _write_error(self, request_id: Any, error: dict[str, Any], status: int, *, keep_alive: bool) -> None:
        self._lane.metrics.errors.labels(str(error.get("code"))).inc()
        body = dumps(error_response(request_id, error))
        self._write(self.own_head(status, "application/json", keep_alive, len(body)) + body)

    def own_head(self, status: int, content_type: str, keep_alive: bool, length: int | None) -> bytes:
        """The head of an answer the proxy makes itself (an error, a bridged call's), as aiohttp would write it."""
        head = f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: {content_type}\r\n"
        head += f"Date: {self._lane.date()}\r\nServer: {SERVER_SOFTWARE}\r\n"
        head += f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n"
        if not keep_alive or self._closing:
            head += "Connection: close\r\n"
        return head.encode() + b"\r\n"

    def _write(self, data: bytes) -> None:
        transport = self._transport
        if transport is None:
            raise ConnectionResetError("the client closed the connection")
        self._head_sent = True
        transport.write(data)

    async def _drain(self) -> None:
        paused = self._write_paused
        if paused is not None:
            if not paused.done():
                await paused
            elif paused.exception() is not None:
                raise ConnectionResetError("the client closed the connection")
        if self._transport is None:
            raise ConnectionResetError("the client closed the connection")

    def _answered(self, keep_alive: bool) -> None:
        transport = self._transport
        if transport is None:
            return
        if not keep_alive or self._closing:
            transport.close()
            return
        self._reading, self._head_bytes = "head", 0
        self.deadline = self._lane.loop.time() + self._lane.header_timeout_s
        pending, self._pending = self._pending, bytearray()
        if pending:
            transport.resume_reading()
            self._feed(bytes(pending))

    # stopping

    def close_when_idle(self) -> None:
        if self.running is None and not self.visiting:
            self.abort()
        else:
            self._closing = True

    def abort(self) -> None:
        self.deadline = _NEVER
        if self._transport is not None:
            self._transport.close()


_SERVER = f"Server: {SERVER_SOFTWARE}\r\n".encode()


class _LaneReply:
    """A bridged call's answer (proxy/upstream/bridge.py) written by the lane: one JSON body, or an event stream
    once progress came, as bridge.StreamReply writes it on aiohttp."""

    def __init__(self, connection: _LaneConnection, keep_alive: bool) -> None:
        self._connection = connection
        self._keep_alive = keep_alive
        self._streaming = False

    async def event(self, message: dict[str, Any]) -> None:
        connection = self._connection
        if not self._streaming:
            self._streaming = True
            head = connection.own_head(200, "text/event-stream", self._keep_alive, None)
            connection._write(head[:-2] + b"Cache-Control: no-cache\r\n\r\n")
        data = b"event: message\ndata: " + dumps(message) + b"\n\n"
        connection._write(b"%x\r\n%s\r\n" % (len(data), data))
        await connection._drain()

    async def finish(self, message: dict[str, Any], status: int = 200) -> int:
        connection = self._connection
        if not self._streaming:
            body = dumps(message)
            connection._write(connection.own_head(status, "application/json", self._keep_alive, len(body)) + body)
            return status
        await self.event(message)
        connection._write(b"0\r\n\r\n")
        return 200
