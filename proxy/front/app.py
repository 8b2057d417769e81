"""The aiohttp application: its resources and their lifetimes, the routes, the request context and the one error
boundary every route's handler runs behind, and the proxy's own endpoints (/healthz, /readyz, /metrics); dispatch.py
handles the rest."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime
from typing import Any

import structlog
from aiohttp import web

from .. import console
from ..clients.durable import DurableCalls
from ..clients.kept_alive import KeptAliveCalls
from ..clients.tasks2025 import Tasks2025
from ..clients.tasks2026 import Tasks2026
from ..clients.translated2025 import Translated2025
from ..config import ProxyConfig
from ..jsonrpc import INVALID_REQUEST, error_object, error_response
from ..metrics import Metrics
from ..policy import LivePolicy
from ..security import HostGuard, Identity, PollGuard, keep_shared_key
from ..store.base import MemoryTaskStore, StoreUnavailable, TaskStore
from ..store.redis_store import RedisTaskStore
from ..tasks.model import utc_now
from ..tasks.runner import TaskRunner
from ..tasks.sealing import CallSeal
from ..tokens import WELL_KNOWN, TokenRefused
from ..upstream import build_gateway
from ..upstream.bridge import SyncBridge
from ..upstream.events import UpstreamUnavailable
from ..upstream.gateway import Gateway
from ..upstream.http.answer import client_gone_key
from . import boundary
from .concurrency import Concurrency
from .context import (
    MCP_PATH,
    RequestInfo,
    bridge_key,
    concurrency_key,
    durable_key,
    gateway_key,
    guard_key,
    identity_key,
    info_key,
    json_reply,
    kept_alive_key,
    local_paths_key,
    metrics_key,
    policy_key,
    poll_guard_key,
    rates_key,
    read_headers_key,
    runner_key,
    store_key,
    tasks2025_key,
    tasks2026_key,
    translated_key,
)
from .dispatch import handle_mcp_post, handle_other
from .rates import Rates
from .session_routing import SessionRouting

log = structlog.get_logger(__name__)

LOCAL_PATHS = frozenset({"/healthz", "/readyz", "/metrics", WELL_KNOWN, WELL_KNOWN + MCP_PATH})
"""The proxy's own pages: never forwarded, asked for no token, logged by no request line; and the console's when it
is on (its page loads without a token; what it asks of /mcp carries one)."""


def create_app(
    config: ProxyConfig,
    *,
    store: TaskStore | None = None,
    now: Callable[[], datetime] = utc_now,
    timer: Callable[[], float] = time.monotonic,
) -> web.Application:
    """Build the application without starting anything; tests and the CLI both call this."""
    app = web.Application(client_max_size=config.limits.max_body_bytes)
    app[policy_key] = policy = LivePolicy(config)
    app[metrics_key] = Metrics()
    app[store_key] = store if store is not None else build_store(config, timer=timer)
    app[identity_key] = identity = Identity(config.security, shared_store=app[store_key].shared)
    principal_header = {config.security.principal_header.lower()} if config.security.principal == "header" else set()
    app[read_headers_key] = _READ_HEADERS | principal_header
    app[metrics_key].watch(
        "mcp_tasks_proxy_store_errors", "Calls to the task store that failed, by operation (Redis unreachable, slow, "
        "refusing writes or answering garbage)", "operation", lambda: dict(app[store_key].failures), counter=True,
    )  # fmt: skip
    app[poll_guard_key] = PollGuard(config.limits.min_poll_interval_ms, timer=timer)
    app[guard_key] = HostGuard(config)
    app[rates_key] = Rates(lambda: policy.config.limits, app[store_key], app[metrics_key], timer=timer)
    app[concurrency_key] = Concurrency(lambda: policy.config.limits, app[store_key], app[metrics_key], timer=timer)

    async def upstream_ctx(app: web.Application) -> AsyncIterator[None]:
        async with build_gateway(config, identity, max_bytes=lambda: policy.config.limits.max_result_bytes) as gateway:
            app[gateway_key] = gateway
            app[metrics_key].watch(
                "mcp_tasks_proxy_legacy_sessions", "Open 2025-era sessions: upstream (the proxy's with a 2025 "
                "server) and client (2025 clients' held by the proxy: for a stdio server, or a 2026-only one)", "side",
                gateway.session_counts,
            )  # fmt: skip
            if gateway.unreadable_counts is not None:
                app[metrics_key].watch_unreadable(gateway.unreadable_counts)
            legacy = gateway.legacy
            app[bridge_key] = SyncBridge(
                legacy,
                identity,
                round_wait_s=config.upstream.round_wait_s,
                max_bytes=lambda: policy.config.limits.max_result_bytes,
                max_questions=lambda: policy.config.tasks.max_input_rounds,
                owner=lambda: app[runner_key].replica_id,  # (the runner exists by the time a call is parked)
            )
            gateway.ends_rounds(app[bridge_key].end_round)
            app[translated_key] = Translated2025(
                gateway, gateway.front_sessions, identity, max_bytes=lambda: policy.config.limits.max_result_bytes
            )
            probe = asyncio.ensure_future(_probe_era(app[gateway_key]))
            yield
            probe.cancel()
            await app[bridge_key].aclose()

    async def store_ctx(app: web.Application) -> AsyncIterator[None]:
        await app[store_key].eviction_risk()  # logs a store setting that would lose tasks, once at start
        yield
        await app[store_key].aclose()

    async def identity_ctx(app: web.Application) -> AsyncIterator[None]:
        if identity.verifier is not None:  # the issuer's keys before the first request (a failure is logged, not fatal)
            await identity.verifier.keys.refresh()
        if not identity.from_store:
            yield
            return
        try:
            await identity.agree(app[store_key])
        except StoreUnavailable as exc:
            # Serve anyway: what needs an owner answers "store unavailable" until the key loads, /readyz says why.
            log.warning("principal_key_unavailable_at_start", reason=str(exc))
        keeper = asyncio.ensure_future(keep_shared_key(identity, app[store_key], interval_s=config.store.lease_s))
        yield
        keeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keeper

    draining: list[asyncio.Future[None]] = []  # (held here: a future nothing references may be collected mid-drain)

    async def runner_ctx(app: web.Application) -> AsyncIterator[None]:
        runner = TaskRunner(
            app[store_key],
            app[gateway_key],
            lambda: policy.config.tasks,
            lambda: policy.config.limits,
            now=now,
            timer=timer,
            reap_interval_s=config.store.reap_interval_s,
            reconcile_interval_s=config.store.reconcile_interval_s,
            lease_s=config.store.lease_s,
            round_wait_s=config.upstream.round_wait_s,
            input_wait_s=config.upstream.input_wait_s,
            metrics=app[metrics_key],
            rule_for=lambda tool: policy.config.rule_for(tool),
            seal=CallSeal(identity.operator_key) if identity.operator_key is not None else None,
            credentials_follow=config.security.principal in ("jwt", "header"),
            slots_for=app[concurrency_key].claim_for_call,
        )
        app[runner_key] = runner
        app[gateway_key].ends_rounds(runner.end_round)
        app[gateway_key].serves_as(lambda: runner.replica_id)
        app[durable_key] = DurableCalls(runner, app[store_key], app[identity_key], app[translated_key])
        app[kept_alive_key] = KeptAliveCalls(runner, app[store_key], app[identity_key])
        app[tasks2025_key] = Tasks2025(
            runner, app[store_key], app[identity_key], app[poll_guard_key], app[translated_key]
        )
        app[tasks2026_key] = Tasks2026(runner, app[store_key], app[identity_key], app[poll_guard_key])
        try:
            await runner.start()
        except StoreUnavailable as exc:
            # Start anyway: /readyz says not ready, and the store is retried by every request that needs it.
            log.warning("store_unavailable_at_start", reason=str(exc))
        yield
        await app[runner_key].aclose(config.tasks.shutdown_grace_s)
        await app[concurrency_key].aclose()

    async def stop_taking_over(app: web.Application) -> None:
        # From the moment the proxy is told to stop (before its connections' grace): a call another replica hands
        # over now would only be handed over again, or run twice. And the tasks drain from then on, beside the
        # connections' grace rather than after it: the streams that wait for them (kept-alive and durable calls)
        # end with their outcome, and subscriptions/listen streams end at once (runner.stopping).
        if runner_key in app:
            runner = app[runner_key]
            runner.stop_taking_over()
            draining.append(asyncio.ensure_future(runner.aclose(config.tasks.shutdown_grace_s)))

    # Unwinds in reverse: the runner stops before the store and the upstream session close.
    app.cleanup_ctx.extend([upstream_ctx, store_ctx, identity_ctx, runner_ctx])
    app.on_shutdown.append(stop_taking_over)
    app.on_response_prepare.append(_end_after_chunked)
    app.router.add_get("/healthz", served(healthz))
    app.router.add_get("/readyz", served(readyz))
    app.router.add_get("/metrics", served(metrics))
    if config.security.resource_metadata is not None:  # else the upstream's, if it has one, like any other path
        for path in (WELL_KNOWN, WELL_KNOWN + MCP_PATH):
            app.router.add_get(path, served(resource_metadata))
    post, other = handle_mcp_post, handle_other
    if config.listen.advertise_url is not None:
        if app[store_key].shared:
            app[store_key].advertise(str(config.listen.advertise_url))
            routing = SessionRouting(app[store_key], identity, lambda: app[runner_key].replica_id)
            app.on_response_prepare.append(routing.on_response_prepare)
            app.on_cleanup.append(lambda _: routing.aclose())
            post, other = routing.routed(post), routing.routed(other)
        else:
            log.warning("advertise_url_unused", reason="replicas share sessions only through the Redis store")
    app[local_paths_key] = LOCAL_PATHS
    if config.listen.console_on:
        console.add_routes(app, policy, served)
        app[local_paths_key] = LOCAL_PATHS | console.PATHS
        if not config.listen.is_loopback and config.security.allowed_origins is None:
            # Browsers send Origin with the page's requests, and off loopback no origin is allowed by default.
            log.warning("console_origin_not_allowed", reason="the console is on but security.allowed_origins is "
                        "unset: its requests to /mcp get 403 until the page's origin is listed there")  # fmt: skip
    app.router.add_post(MCP_PATH, served(post))
    other = served(other)
    app.router.add_route("*", MCP_PATH, other)
    app.router.add_route("*", "/{tail:.*}", other)
    return app


# --- what every request runs through ------------------------------------------------------------------------------

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def served(handler: Handler) -> Handler:
    """`handler` behind the request context, the Host/Origin guard and the error boundary, in one coroutine: with no
    aiohttp middleware aiohttp calls it directly, sparing a partial and two frames per request."""
    return functools.partial(_in_context, handler)


async def _in_context(handler: Handler, request: web.Request) -> web.StreamResponse:
    """`handler` behind the front door's boundary (proxy/front/boundary.py), as the lane serves its requests."""
    app = request.app
    metrics = app[metrics_key]
    unreadable = _unreadable_header(request)
    boundary.bind_request(request.headers if unreadable is None else None)
    started = time.perf_counter()
    info = request[info_key] = RequestInfo()
    request[client_gone_key] = False  # set, so that reading it is a dict lookup, not the Mapping mixin's KeyError
    status = 500
    try:
        if unreadable is not None:
            reason = f"Invalid request: the {unreadable} header holds bytes that are not UTF-8"
            response = _json_error(
                request, *boundary.refusal(error_object(INVALID_REQUEST, reason), 400, info, metrics)
            )
        elif refused := boundary.refused_by_guard(app[guard_key], request.headers):
            response = _json_error(request, *boundary.refusal(*refused, info, metrics))
        else:
            verifier = app[identity_key].verifier
            try:
                # (By the path as sent: /console%2Fx is routed upstream, so it is not the console's, and is checked.)
                if verifier is not None and request.rel_url.raw_path not in app[local_paths_key]:
                    await verifier.verify(request.headers)
                response = await handler(request)
            except web.HTTPException:
                raise
            except TokenRefused as exc:  # (a scope a tool needs is checked once the message is read: dispatch.py)
                assert verifier is not None
                body, refused_status, headers = boundary.token_refusal(exc, verifier, info, metrics)
                response = web.Response(body=body, status=refused_status, headers=headers,
                                        content_type="application/json")  # fmt: skip
            except Exception as exc:  # no request sees a traceback
                transport = request.transport
                answered = boundary.failure(exc, info, metrics, client_gone=transport is None or transport.is_closing())
                if answered is None:
                    request[client_gone_key] = True
                    response = web.Response(status=499)
                else:
                    response = _json_error(request, answered[0], answered[1])
                    if (wait := boundary.retry_after(exc)) is not None:
                        response.headers["Retry-After"] = wait
        status = 499 if request[client_gone_key] else response.status
        return response
    except asyncio.CancelledError:
        # aiohttp cancels the handler when the client closes its connection (handler_cancellation): the client left,
        # nothing failed. 499 as nginx counts it.
        status = 499
        request[client_gone_key] = True
        raise
    finally:
        if request.path not in app[local_paths_key]:
            boundary.done(
                info,
                policy=app[policy_key],
                metrics=metrics,
                identity=app[identity_key],
                headers=request.headers if unreadable is None else None,
                http_method=request.method,
                path=request.path,
                status=status,
                started=started,
            )


_READ_HEADERS = frozenset(
    name.lower()
    for name in (
        "Authorization", "Mcp-Session-Id", "Mcp-Method", "Mcp-Name", "MCP-Protocol-Version", "Last-Event-ID",
        "Accept", "Content-Type", "Host", "Origin", "traceparent", "tracestate",
    )
)  # fmt: skip
"""Headers the proxy reads itself; the rest pass through byte for byte."""


def _unreadable_header(request: web.Request) -> str | None:
    """The first header the proxy reads whose value holds bytes that are not UTF-8 (aiohttp keeps them as lone
    surrogates, which would fail wherever the value is hashed, logged or sent on); None when there is none."""
    for name, value in request.raw_headers:
        if value.isascii():  # the common case: one C call per header, on the bytes as received
            continue
        try:
            value.decode()
        except UnicodeDecodeError:
            text = name.decode("utf-8", "surrogateescape")
            if text.lower() in request.app[read_headers_key]:
                return text
    return None


def _json_error(request: web.Request, error: dict[str, Any], status: int) -> web.Response:
    """An error the boundary counted already (boundary.refusal), as the request's JSON-RPC answer."""
    return json_reply(error_response(request[info_key].jsonrpc_id, error), status=status)


async def _end_after_chunked(request: web.Request, response: web.StreamResponse) -> None:
    """A chunked request's connection ends after its answer: aiohttp's parser (3.14.5) makes the body's last trailer
    field the next request's first header on that connection, so behind a front proxy that pools connections one
    caller's trailer would be read as the next caller's Authorization. (The lane reads chunked POSTs to the MCP
    endpoint itself and keeps no trailer; this covers what aiohttp reads.)"""
    if "Transfer-Encoding" in request.headers:
        response.force_close()
        response.headers["Connection"] = "close"  # (the head is written after this signal: it says so)


# --- handlers -----------------------------------------------------------------------------------------------------


async def healthz(request: web.Request) -> web.Response:
    """The process serves; never forwarded upstream."""
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text format; never forwarded upstream."""
    return web.Response(body=request.app[metrics_key].render(), content_type="text/plain", charset="utf-8")


async def resource_metadata(request: web.Request) -> web.Response:
    """The Protected Resource Metadata document (RFC 9728) from the policy: where clients find the authorization
    server; never forwarded upstream."""
    security = request.app[policy_key].config.security
    assert security.resource_metadata is not None and security.resource_url is not None
    document = {"resource": str(security.resource_url)}
    document |= security.resource_metadata.model_dump(mode="json", exclude_none=True)
    if security.jwt is not None:
        document.setdefault("bearer_methods_supported", ["header"])
        document.setdefault("resource_signing_alg_values_supported", list(security.jwt.algorithms))
    return web.json_response(document, headers={"Cache-Control": "max-age=3600"})


async def readyz(request: web.Request) -> web.Response:
    """Ready when the task store answers and the upstream accepts connections; never forwarded upstream."""
    checks: dict[str, str] = {}
    try:
        await request.app[store_key].ping()
        checks["store"] = "ok"
    except StoreUnavailable as exc:
        checks["store"] = str(exc)
    if not request.app[identity_key].keyed:
        checks["principal_key"] = "not loaded yet: the replicas' shared key is kept in the store"
    checks["upstream"] = await request.app[gateway_key].relay.readiness()
    ready = all(value == "ok" for value in checks.values())
    body: dict[str, Any] = {"status": "ready" if ready else "not ready", **checks}
    # A setting that puts tasks at risk is said, but takes no replica out of service: they all share it.
    risk = await request.app[store_key].eviction_risk()
    if risk is not None:
        body["warnings"] = [risk]
    return web.json_response(body, status=200 if ready else 503)


def build_store(config: ProxyConfig, *, timer: Callable[[], float] = time.monotonic) -> TaskStore:
    if config.store.backend == "redis":
        assert config.store.url is not None
        return RedisTaskStore(
            config.store.url,
            key_prefix=config.store.key_prefix,
            lease_s=config.store.lease_s,
            timeout_s=config.store.timeout_s,
            tls=config.store.tls,
        )
    return MemoryTaskStore(max_tasks=config.tasks.max_tasks, timer=timer)


async def _probe_era(gateway: Gateway) -> None:
    """Learn the era at start-up, so the first request does not wait; an unreachable upstream is probed later."""
    try:
        await gateway.era()
    except UpstreamUnavailable as exc:
        log.warning("upstream_era_unknown", reason=exc.args[0])
