"""Serving the application: bind first, then start, then announce; bounded client connections; clean stop.

aiohttp's run_app binds after the application has started and offers no cap on connections, so the proxy runs
its own short loop on aiohttp's public runner API instead:
- the listening socket is bound before anything else starts, so a port in use is one clear line, not a traceback
  after a "started" log line;
- every client connection must deliver a complete request head within `listen.header_timeout_s` (aiohttp's
  keep-alive timer, which runs from the connection's start and between requests, closes it otherwise): slowloris
  clients and idle keep-alive connections cost a socket for that long at most;
- past `listen.max_connections` open client connections, a new one is answered 503 and closed at once;
- SIGTERM and SIGINT stop it gracefully: running tasks get `tasks.shutdown_grace_s` to finish.
"""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import Callable

import structlog
from aiohttp import web

from ..config import ListenConfig
from ..jsonrpc import INTERNAL_ERROR, dumps, error_object, error_response
from .lane import Lane, open_lane

log = structlog.get_logger(__name__)
SHUTDOWN_TIMEOUT_S = 15


_stop_requested = False


def hold_stop_signals() -> None:
    """From now until serve() takes them over, SIGTERM and SIGINT are remembered instead of killing the process:
    the socket takes connections from bind() on, and an orchestrator (or a test) may stop the proxy at once."""

    def remember(signum: int, frame: object) -> None:
        global _stop_requested
        _stop_requested = True

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, remember)


class BindError(Exception):
    """The listening address cannot be used; the message says which and why."""


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound (or BindError naming the address and the reason)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise BindError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        raise BindError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    sock.setblocking(False)
    return sock


def _refusal(max_connections: int) -> bytes:
    error = error_object(
        INTERNAL_ERROR,
        f"Too many connections: this proxy serves at most {max_connections} at once (listen.max_connections)",
    )
    body = dumps(error_response(None, error))
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\nRetry-After: 1\r\n\r\n"
    )
    return head.encode() + body


def cap_connections(
    server: web.Server, max_connections: int, on_refused: Callable[[], None], *, lane: Lane | None = None
) -> Callable[[asyncio.Transport], bool]:
    """Answer 503 and close every connection past `max_connections` open ones (aiohttp's and the lane's); returns
    the check for the lane's new connections."""
    refusal = _refusal(max_connections)
    accept = server.connection_made

    def admitted(transport: asyncio.Transport) -> bool:
        on_lane = len(lane.connections) if lane is not None else 0
        if len(server.connections) + on_lane <= max_connections:
            return True
        on_refused()
        transport.write(refusal)
        transport.close()
        return False

    def connection_made(handler: web.RequestHandler, transport: asyncio.Transport) -> None:  # type: ignore[type-arg]
        accept(handler, transport)
        if lane is None or not lane.own:  # a lane connection aiohttp takes over was admitted already
            admitted(transport)

    server.connection_made = connection_made  # type: ignore[method-assign]
    return admitted


class _LaneSite(web.SockSite):
    """The bound socket, served by the pass-through lane, which hands aiohttp every request it does not relay."""

    def __init__(self, runner: web.AppRunner, sock: socket.socket, lane: Lane) -> None:
        super().__init__(runner, sock)
        self._lane = lane

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with the runner; SockSite's would serve aiohttp directly
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._lane, sock=self._sock, backlog=self._backlog)


async def start(
    app: web.Application, sock: socket.socket, listen: ListenConfig, *, on_refused: Callable[[], None]
) -> tuple[web.AppRunner, Lane]:
    """Start `app` and serve the bound `sock` (the lane first, aiohttp for what it hands over); stop it with
    `runner.cleanup()`."""
    runner = web.AppRunner(
        app,
        handle_signals=False,
        access_log=None,
        # handler_cancellation: a client that closes its stream cancels the relay, which closes the upstream one.
        handler_cancellation=True,
        keepalive_timeout=listen.header_timeout_s,
        # aiohttp waits this long twice for a handler still running (for it to end, then once more after it
        # cancelled the request's body): half the budget each, so that its answers get SHUTDOWN_TIMEOUT_S in all.
        shutdown_timeout=SHUTDOWN_TIMEOUT_S / 2,
    )
    lanes: list[Lane] = []
    stopping: list[asyncio.Task[None]] = []

    async def stop_lane(_: web.Application) -> None:
        # After the socket stopped taking connections: the lane's answers owed get their time beside aiohttp's
        # (which the runner waits for next), not before them, so that a stop takes SHUTDOWN_TIMEOUT_S, not twice.
        stopping.extend(asyncio.create_task(lane.shutdown(SHUTDOWN_TIMEOUT_S)) for lane in lanes)

    async def lane_stopped(_: web.Application) -> None:
        # Before the upstream client closes (the first of the cleanups, ahead of the app's contexts).
        await asyncio.gather(*stopping)

    app.on_shutdown.append(stop_lane)
    app.on_cleanup.insert(0, lane_stopped)
    await runner.setup()
    try:
        assert runner.server is not None
        lane = open_lane(app, runner.server, header_timeout_s=listen.header_timeout_s)
        lane.admit = cap_connections(runner.server, listen.max_connections, on_refused, lane=lane)
        lanes.append(lane)
        await _LaneSite(runner, sock, lane).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, lane


async def serve(
    app: web.Application,
    sock: socket.socket,
    listen: ListenConfig,
    *,
    on_refused: Callable[[], None],
    announce: Callable[[], None],
) -> None:
    """Run `app` on the bound `sock` until SIGTERM or SIGINT."""
    # First: the socket may already take connections (a readiness probe, a test, an orchestrator that stops a pod
    # at once), and a signal during start-up must stop the proxy gracefully, not by the default action.
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    if _stop_requested:  # a signal came between bind() and here (hold_stop_signals)
        stopping.set()
    runner, lane = await start(app, sock, listen, on_refused=on_refused)
    try:
        announce()
        await stopping.wait()
        # Open connections (streams, calls in flight) get up to the runner's shutdown_timeout before tasks drain.
        assert runner.server is not None
        open_connections = len(runner.server.connections) + len(lane.connections)
        log.info("proxy_stopping", open_connections=open_connections, wait_s=SHUTDOWN_TIMEOUT_S)
    finally:
        await runner.cleanup()
    log.info("proxy_stopped")
