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

from .config import ListenConfig
from .jsonrpc import INTERNAL_ERROR, dumps, error_object, error_response

log = structlog.get_logger(__name__)
SHUTDOWN_TIMEOUT_S = 15


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


def cap_connections(server: web.Server, max_connections: int, on_refused: Callable[[], None]) -> None:
    """Answer 503 and close every connection past `max_connections` open ones."""
    refusal = _refusal(max_connections)
    accept = server.connection_made

    def connection_made(handler: web.RequestHandler, transport: asyncio.Transport) -> None:  # type: ignore[type-arg]
        accept(handler, transport)
        if len(server.connections) > max_connections:
            on_refused()
            transport.write(refusal)
            transport.close()

    server.connection_made = connection_made  # type: ignore[method-assign]


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
    runner = web.AppRunner(
        app,
        handle_signals=False,
        access_log=None,
        # handler_cancellation: a client that closes its stream cancels the relay, which closes the upstream one.
        handler_cancellation=True,
        keepalive_timeout=listen.header_timeout_s,
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )
    await runner.setup()
    try:
        assert runner.server is not None
        cap_connections(runner.server, listen.max_connections, on_refused)
        await web.SockSite(runner, sock).start()
        announce()
        await stopping.wait()
        # Open connections (streams, calls in flight) get up to the runner's shutdown_timeout before tasks drain.
        log.info("proxy_stopping", open_connections=len(runner.server.connections), wait_s=SHUTDOWN_TIMEOUT_S)
    finally:
        await runner.cleanup()
    log.info("proxy_stopped")
