"""The aiohttp application: routes, the error boundary, and POST /mcp dispatch (owned methods vs pass-through)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import datetime
from typing import Any

import structlog
from aiohttp import web

from . import TASKS_EXTENSION, listen, tasks2025, tracing
from .config import ProxyConfig, TaskMode
from .durable import DurableCalls, wants_event_stream
from .envelope import (
    META_CLIENT_CAPABILITIES,
    check_batch_routing_headers,
    check_modern_request,
    check_routing_headers,
    declares_tasks,
    is_modern,
    meta_of,
    params_of,
    without_tasks_declaration,
)
from .jsonrpc import (
    ERROR_HTTP_STATUS,
    INTERNAL_ERROR,
    INVALID_PARAMS,
    INVALID_REQUEST,
    METHOD_NOT_FOUND,
    PARSE_ERROR,
    JsonRpcError,
    UpstreamError,
    classify,
    dumps,
    error_object,
    error_response,
    is_valid_id,
    loads,
    result_response,
)
from .metrics import Metrics, method_label
from .policy import LivePolicy
from .security import HostGuard, Identity, PollGuard, keep_shared_key
from .tasks.job import DirectOutcome, ToolCall
from .tasks.model import TaskRecord, utc_now
from .tasks.redis_store import RedisTaskStore
from .tasks.runner import LimitReached, ShuttingDown, TaskRunner
from .tasks.store import MemoryTaskStore, StoreFullError, StoreUnavailable, TaskStore
from .tasks2025 import Tasks2025
from .tasks2026 import Tasks2026, missing_tasks_capability
from .upstream import build_gateway
from .upstream.bridge import SyncBridge
from .upstream.events import UpstreamUnavailable
from .upstream.gateway import Gateway
from .upstream.http.relay import client_gone_key

log = structlog.get_logger(__name__)

policy_key = web.AppKey("policy_key", LivePolicy)
store_key = web.AppKey("store_key", TaskStore)
runner_key = web.AppKey("runner_key", TaskRunner)
gateway_key = web.AppKey("gateway_key", Gateway)
bridge_key = web.AppKey("bridge_key", SyncBridge)
metrics_key = web.AppKey("metrics_key", Metrics)
identity_key = web.AppKey("identity_key", Identity)
guard_key = web.AppKey("guard_key", HostGuard)
poll_guard_key = web.AppKey("poll_guard_key", PollGuard)
durable_key = web.AppKey("durable_key", DurableCalls)
tasks2025_key = web.AppKey("tasks2025_key", Tasks2025)
tasks2026_key = web.AppKey("tasks2026_key", Tasks2026)
read_headers_key = web.AppKey("read_headers_key", frozenset)
"""The headers this app reads itself, lowercase: the fixed ones, and the principal header when it has one."""


@dataclasses.dataclass(slots=True)
class RequestInfo:
    """What the request log line reports, filled in as dispatch learns it."""

    jsonrpc_id: Any = None
    rpc_method: str | None = None
    tool: str | None = None
    task_id: str | None = None
    mode: str = "passthrough"
    answers_2025: bool = False
    """The proxy answers a 2025-era client itself: every error goes on HTTP 200, as that era's clients expect."""
    task_trace: str | None = None
    """The traceparent of the task this request is about, for its span to link to."""
    trace: Any = None
    """The request's span and context token while tracing is on (proxy/tracing.py)."""


info_key = web.RequestKey("info_key", RequestInfo)

MCP_PATH = "/mcp"
LOCAL_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
VERBOSE_LEVELS = frozenset({"debug", "info"})
# Request ids: unique per process and cheap (no random bytes per request); the prefix tells processes apart.
_REQUEST_ID_PREFIX = f"{secrets.token_hex(4)}-"
_request_numbers = itertools.count(1)


def create_app(
    config: ProxyConfig,
    *,
    store: TaskStore | None = None,
    now: Callable[[], datetime] = utc_now,
    timer: Callable[[], float] = time.monotonic,
) -> web.Application:
    """Build the application without starting anything; tests and the CLI both call this."""
    app = web.Application(
        middlewares=[request_context, error_boundary],
        client_max_size=config.limits.max_body_bytes,
    )
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

    async def upstream_ctx(app: web.Application) -> AsyncIterator[None]:
        async with build_gateway(config, identity, max_bytes=lambda: policy.config.limits.max_result_bytes) as gateway:
            app[gateway_key] = gateway
            app[metrics_key].watch(
                "mcp_tasks_proxy_legacy_sessions", "Open 2025-era sessions: upstream (the proxy's with a 2025 "
                "server) and client (2025 clients' with the proxy, for a stdio server)", "side", gateway.session_counts,
            )  # fmt: skip
            if gateway.unreadable_counts is not None:
                app[metrics_key].watch_unreadable(gateway.unreadable_counts)
            legacy = gateway.legacy
            app[bridge_key] = SyncBridge(
                legacy,
                identity,
                input_wait_s=config.upstream.input_wait_s,
                max_bytes=lambda: policy.config.limits.max_result_bytes,
                max_questions=lambda: policy.config.tasks.max_input_rounds,
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
            input_wait_s=config.upstream.input_wait_s,
            metrics=app[metrics_key],
        )
        app[runner_key] = runner
        app[durable_key] = DurableCalls(runner, app[store_key], app[identity_key])
        app[tasks2025_key] = Tasks2025(runner, app[store_key], app[identity_key], app[poll_guard_key])
        app[tasks2026_key] = Tasks2026(runner, app[store_key], app[identity_key], app[poll_guard_key])
        try:
            await runner.start()
        except StoreUnavailable as exc:
            # Start anyway: /readyz says not ready, and the store is retried by every request that needs it.
            log.warning("store_unavailable_at_start", reason=str(exc))
        yield
        await app[runner_key].aclose(config.tasks.shutdown_grace_s)

    # Unwinds in reverse: the runner stops before the store and the upstream session close.
    app.cleanup_ctx.extend([upstream_ctx, store_ctx, identity_ctx, runner_ctx])
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_post(MCP_PATH, handle_mcp_post)
    app.router.add_route("*", MCP_PATH, handle_other)
    app.router.add_route("*", "/{tail:.*}", handle_other)
    return app


# --- middleware ---------------------------------------------------------------------------------------------------

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def request_context(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Bind a request id for every log line of this request, and write one line when it is done."""
    structlog.contextvars.clear_contextvars()
    unreadable = _unreadable_header(request)
    client_id = request.headers.get("X-Request-Id") if unreadable is None else None
    request_id = client_id if _usable_request_id(client_id) else f"{_REQUEST_ID_PREFIX}{next(_request_numbers):x}"
    structlog.contextvars.bind_contextvars(request_id=request_id)
    started = time.perf_counter()
    info = request[info_key] = RequestInfo()
    status = 500
    try:
        if unreadable is not None:
            status = 400
            reason = f"Invalid request: the {unreadable} header holds bytes that are not UTF-8"
            return _json_error(request, error_object(INVALID_REQUEST, reason), 400)
        response = await handler(request)
        status = 499 if request.get(client_gone_key) else response.status
        return response
    except asyncio.CancelledError:
        # aiohttp cancels the handler when the client closes its connection (handler_cancellation): the client left,
        # nothing failed. 499 as nginx counts it.
        status = 499
        request[client_gone_key] = True
        raise
    finally:
        if info.trace is not None:
            tracing.TRACER.end_request(  # type: ignore[union-attr]
                info.trace, status=status, task_id=info.task_id, task_trace=info.task_trace, mode=info.mode
            )
        if request.path not in LOCAL_PATHS:
            elapsed_s = time.perf_counter() - started
            request.app[metrics_key].observe_request(method_label(info.rpc_method), info.mode, status, elapsed_s)
            if request.app[policy_key].config.logging.level in VERBOSE_LEVELS:  # spare the work when not logged
                log.info(
                    "request_handled",
                    principal=request.app[identity_key].logged_principal(request.headers)
                    if unreadable is None
                    else None,
                    http_method=request.method,
                    path=request.path,
                    method=info.rpc_method,
                    tool=info.tool,
                    task_id=info.task_id,
                    mode=info.mode,
                    status=status,
                    client_closed=bool(request.get(client_gone_key)),
                    duration_ms=round(elapsed_s * 1000, 2),
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
    for name, value in request.headers.items():
        if value.isascii():  # the common case: one C call per header
            continue
        try:
            value.encode()
        except UnicodeEncodeError:
            if name.lower() in request.app[read_headers_key]:
                return name
    return None


def _usable_request_id(value: str | None) -> bool:
    """A client's X-Request-Id goes into every log line of its request: only a short printable one."""
    return value is not None and 0 < len(value) <= 128 and value.isascii() and value.isprintable()


def _refused_by_guard(request: web.Request) -> web.Response | None:
    """Host and Origin values the policy does not allow (DNS rebinding) are refused before anything else runs."""
    guard = request.app[guard_key]
    if not guard.host_allowed(request.headers.get("Host")):
        return _json_error(request, error_object(INVALID_REQUEST, "Invalid Host header (security.allowed_hosts)"), 421)
    if not guard.origin_allowed(request.headers.get("Origin")):
        return _json_error(request, error_object(INVALID_REQUEST, "Origin not allowed (security.allowed_origins)"), 403)
    return None


@web.middleware
async def error_boundary(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The Host/Origin guard, then the one place exceptions become wire errors: no request sees a traceback."""
    refused = _refused_by_guard(request)
    if refused is not None:
        return refused
    try:
        return await handler(request)
    except JsonRpcError as exc:
        return _json_error(request, exc.to_error(), exc.http_status)
    except UpstreamError as exc:
        log.warning("upstream_error", reason=exc.reason)
        request.app[metrics_key].upstream_errors.labels("request").inc()
        return _json_error(request, exc.to_error(), exc.http_status)
    except StoreUnavailable as exc:
        return _json_error(request, error_object(INTERNAL_ERROR, f"Task store unavailable: {exc}"), 503)
    except ShuttingDown as exc:
        return _json_error(request, error_object(INTERNAL_ERROR, f"Cannot create a task: {exc}"), 503)
    except web.HTTPException:
        raise
    except ConnectionResetError:
        if request.transport is not None and not request.transport.is_closing():
            log.exception("unhandled_error")  # not the client's connection: a fault of the proxy's own
            return _json_error(request, error_object(INTERNAL_ERROR, "Internal error in the proxy"), 200)
        # A write to a client that has gone away (a relayed event stream): nobody is left to answer.
        request[client_gone_key] = True
        return web.Response(status=499)
    except Exception:
        log.exception("unhandled_error")
        return _json_error(request, error_object(INTERNAL_ERROR, "Internal error in the proxy"), 200)


def _json_error(request: web.Request, error: dict[str, Any], status: int) -> web.Response:
    request.app[metrics_key].errors.labels(str(error.get("code"))).inc()
    info = request[info_key]
    if info.answers_2025:
        status = 200  # the SDKs of 2025 end the whole session on a 4xx or 5xx to a request of theirs
    if info.mode == "passthrough":
        info.mode = "local"
    return _json(error_response(info.jsonrpc_id, error), status=status)


def _json(message: dict[str, Any], *, status: int = 200) -> web.Response:
    return web.Response(body=dumps(message), status=status, content_type="application/json")


# --- handlers -----------------------------------------------------------------------------------------------------


async def healthz(request: web.Request) -> web.Response:
    """The process serves; never forwarded upstream."""
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text format; never forwarded upstream."""
    return web.Response(body=request.app[metrics_key].render(), content_type="text/plain", charset="utf-8")


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
        )
    return MemoryTaskStore(max_tasks=config.tasks.max_tasks, timer=timer)


async def handle_other(request: web.Request) -> web.StreamResponse:
    """GET, DELETE and any other path go to the upstream untouched (legacy GET streams, session DELETE, OAuth);
    a GET that resumes a durable call's stream (Last-Event-ID) is the proxy's."""
    if request.method == "GET" and request.path == MCP_PATH and "Last-Event-ID" in request.headers:
        config = request.app[policy_key].config
        resumed = await request.app[durable_key].resume(request, config.rule_for)
        if resumed is not None:
            request[info_key].mode = "durable"
            return resumed
    body = await _read_body(request) if request.can_read_body else None
    return await request.app[gateway_key].relay.relay_other(request, body)


async def handle_mcp_post(request: web.Request) -> web.StreamResponse:
    body = await _read_body(request)
    try:
        message = loads(body)
    except ValueError as exc:
        raise JsonRpcError(PARSE_ERROR, f"Parse error: the request body is not valid JSON ({exc})") from None
    kind = classify(message)
    if kind == "invalid":
        if isinstance(message, dict) and is_valid_id(message.get("id")):
            request[info_key].jsonrpc_id = message["id"]
        raise JsonRpcError(
            INVALID_REQUEST,
            'Invalid request: expected a JSON-RPC 2.0 object with "jsonrpc": "2.0", a string method, '
            "object params and a string or integer id",
        )
    if kind == "notification":
        # Routing headers, a request's or not, must not say something the body does not: a gateway may route on them.
        check_routing_headers(message, request.headers, required=False)
    elif kind == "batch":
        check_batch_routing_headers(message, request.headers)
    relay_to = request.app[gateway_key].relay
    if kind == "response":
        # A client's answer to a request a durable call's stream relayed is the proxy's; any other is the server's.
        request[info_key].answers_2025 = not is_modern(message, request.headers)
        answered = await request.app[durable_key].answer(request, message)
        request[info_key].answers_2025 = False  # answered, or not the proxy's to answer: it goes to the server
        if answered is not None:
            request[info_key].mode = "durable"
            return answered
    elif _is_legacy_cancel(kind, message, request) and await request.app[durable_key].cancelled(request, message):
        request[info_key].mode = "durable"
        return web.Response(status=202)
    if kind != "request":
        # Notifications, responses to a legacy server's requests, and legacy batches are not the proxy's.
        return await relay_to.relay(request, body, message)
    method = message["method"]
    info = request[info_key]
    info.jsonrpc_id = message["id"]
    info.rpc_method = method
    if tracing.TRACER.enabled:
        params = message.get("params")
        tool = params.get("name") if method == "tools/call" and isinstance(params, dict) else None
        info.trace = tracing.TRACER.begin_request(
            request.headers, message, method, tool if isinstance(tool, str) else None
        )
    modern = is_modern(message, request.headers)
    if method.startswith("tasks/") and modern:
        info.mode = "local"
        answer = await request.app[tasks2026_key].handle(request, message, info)
        return _json(result_response(message["id"], answer))
    if modern and (declares_tasks(message) or "task" in params_of(message)):
        # Tasks are the proxy's: the upstream never sees the declaration nor a legacy params.task opt-in.
        body = dumps(without_tasks_declaration(message))

    async def relay() -> web.StreamResponse:
        """Carry the request synchronously, the way the upstream's era needs."""
        if modern and await _era(request) == "legacy":
            # The proxy reads this body to translate it; a legacy upstream cannot check the 2026 headers itself.
            check_modern_request(message, request.headers)
            info.mode = "legacy"
            return await request.app[bridge_key].relay(request, message)
        # Routing headers must not say something the body does not (SEP-2243), in any copy: a gateway in front may
        # have routed on any of them, and a server may check only the first (or, of 2025, none).
        check_routing_headers(message, request.headers, required=False)
        return await relay_to.relay(request, body, message, request_id=message["id"])

    if not modern and method in _SEP1686_ANNOUNCED and await _serves_2025_tasks(request, method):
        # SEP-1686 for 2025-era clients, for the tools the policy names: the proxy's tasks, and what announces them.
        config = request.app[policy_key].config
        limit = config.limits.max_result_bytes
        if method == "initialize":
            # Without credentials and without a session, callers cannot be told apart: no tasks/list for them.
            anonymous = [not request.app[identity_key].principal(request.headers)]

            def sessions(headers: Any) -> None:
                anonymous[0] = anonymous[0] and "Mcp-Session-Id" not in headers

            def advertise(result: dict[str, Any]) -> None:
                tasks2025.advertise(result, anonymous=anonymous[0])

            return await relay_to.relay_rewritten(
                request, body, message["id"], advertise, limit=limit, on_headers=sessions
            )
        if method == "tools/list":

            def mark(result: dict[str, Any]) -> None:
                tasks2025.mark_tools(result, config.rule_for)

            return await relay_to.relay_rewritten(request, body, message["id"], mark, limit=limit)
        if method in tasks2025.METHODS:
            info.mode = "sep1686"
            info.answers_2025 = True
            return await request.app[tasks2025_key].handle(request, message, config.rule_for)
    if method == "subscriptions/listen" and modern:
        return await _listen(request, message)
    if method == "tools/call":
        # The era is not needed up front: a task learns it in the background, a pass-through call in relay().
        return await _tools_call(request, message, relay, modern=modern)
    if method == "server/discover":
        if modern and await _era(request) == "legacy":
            return await _discover_from_legacy(request, message)
        limit = request.app[policy_key].config.limits.max_result_bytes
        return await relay_to.relay_rewritten(request, body, message["id"], _advertise_tasks, limit=limit)
    return await relay()


def _is_legacy_cancel(kind: str, message: Any, request: web.Request) -> bool:
    return (
        kind == "notification"
        and message["method"] == "notifications/cancelled"
        and not is_modern(message, request.headers)
    )


async def _listen(request: web.Request, message: dict[str, Any]) -> web.StreamResponse:
    """subscriptions/listen: task notifications are the proxy's, every other kind the upstream's (merged)."""
    params = params_of(message)
    task_ids, rest = listen.parse_filter(params)
    relay_to = request.app[gateway_key].relay
    if task_ids is None:
        return await relay_to.relay(request, dumps(message), message, request_id=message["id"])
    if not declares_tasks(message):
        raise missing_tasks_capability(
            f"notifications.taskIds needs the {TASKS_EXTENSION} extension declared in this request's "
            '_meta["io.modelcontextprotocol/clientCapabilities"].extensions'
        )
    check_modern_request(message, request.headers)
    request[info_key].mode = "listen"
    upstream_events = None
    limit = request.app[policy_key].config.limits.max_result_bytes
    if listen.wants_upstream(rest) and await _era(request) == "modern":
        upstream_message = without_tasks_declaration(message)
        upstream_message["params"] = {**upstream_message["params"], "notifications": rest}
        upstream_events = await relay_to.open_listen(request, dumps(upstream_message), limit=limit)
    return await listen.stream(
        request,
        message,
        runner=request.app[runner_key],
        store=request.app[store_key],
        principal=request.app[identity_key].principal(request.headers),
        task_ids=task_ids,
        upstream_events=upstream_events,
    )


_SEP1686_METHODS = tasks2025.METHODS | {"initialize", "tools/list", "tools/call"}
_SEP1686_ANNOUNCED = tasks2025.METHODS | {"initialize", "tools/list"}


async def _serves_2025_tasks(request: web.Request, method: str) -> bool:
    """Whether the proxy serves SEP-1686 tasks to this 2025-era request: the policy runs some tool as a task, and
    the server has no SEP-1686 tasks of its own (then its tasks pass through, untouched)."""
    if method not in _SEP1686_METHODS:
        return False
    if not any(rule.task is not TaskMode.NEVER for rule in request.app[policy_key].config.tools):
        return False
    if method == "initialize":
        return True  # the answer says the version and whether the server has tasks of its own (advertise looks)
    if request.headers.get("MCP-Protocol-Version") != tasks2025.VERSION:
        return False  # tasks came with 2025-11-25: an older session is left exactly as it was
    gateway = request.app[gateway_key]
    if await _era(request) == "legacy":
        legacy = gateway.legacy
        if legacy.initialize_result is None:
            try:
                await legacy.session_for(request.headers)
            except (UpstreamUnavailable, ConnectionError, OSError) as exc:
                raise UpstreamError(f"cannot open a session upstream ({exc})", upstream=legacy.url) from exc
        return not tasks2025.has_tool_tasks(legacy.initialize_result or {})
    return True  # a 2026-07-28 server has no SEP-1686 tasks of its own


async def _era(request: web.Request) -> str:
    try:
        return await request.app[gateway_key].era(request.headers)
    except UpstreamUnavailable as exc:
        raise UpstreamError(exc.args[0], upstream=request.app[gateway_key].url) from exc


async def _probe_era(gateway: Gateway) -> None:
    """Learn the era at start-up, so the first request does not wait; an unreachable upstream is probed later."""
    try:
        await gateway.era()
    except UpstreamUnavailable as exc:
        log.warning("upstream_era_unknown", reason=exc.args[0])


async def _discover_from_legacy(request: web.Request, message: dict[str, Any]) -> web.Response:
    """server/discover for a legacy upstream, which has none: answered from its initialize result (NOTES §8)."""
    request[info_key].mode = "legacy"
    check_modern_request(message, request.headers)
    legacy = request.app[gateway_key].legacy
    try:
        await legacy.session_for(request.headers)
    except (UpstreamUnavailable, ConnectionError, OSError) as exc:
        raise UpstreamError(f"cannot open a session upstream ({exc})", upstream=legacy.url) from exc
    return _json(result_response(message["id"], legacy.discover_result()))


async def _read_body(request: web.Request) -> bytes:
    config = request.app[policy_key].config
    limit = config.limits.max_body_bytes
    try:
        async with asyncio.timeout(config.listen.body_timeout_s):
            return await request.read()
    except TimeoutError:
        raise JsonRpcError(
            INVALID_REQUEST,
            f"Request body not received within {config.listen.body_timeout_s:g} s (listen.body_timeout_s)",
            http_status=408,
        ) from None
    except web.HTTPRequestEntityTooLarge:
        raise JsonRpcError(
            INVALID_REQUEST,
            f"Request body too large: the limit is {limit} bytes (limits.max_body_bytes)",
            {"maxBodyBytes": limit},
            http_status=413,
        ) from None


def _advertise_tasks(result: dict[str, Any]) -> None:
    """server/discover: offer the extension, and drop legacy (2025-11-25) task capabilities from the upstream."""
    capabilities = result.get("capabilities")
    if not isinstance(capabilities, dict):
        capabilities = result["capabilities"] = {}
    capabilities.pop("tasks", None)
    extensions = capabilities.get("extensions")
    if not isinstance(extensions, dict):
        extensions = capabilities["extensions"] = {}
    extensions[TASKS_EXTENSION] = {}


async def _tools_call(
    request: web.Request,
    message: dict[str, Any],
    relay: Callable[[], Awaitable[web.StreamResponse]],
    *,
    modern: bool,
) -> web.StreamResponse:
    """A tools/call: a task when its rule and the request say so, else `relay` carries it synchronously."""
    config = request.app[policy_key].config
    params = params_of(message)
    name = params.get("name")
    rule = config.rule_for(name) if isinstance(name, str) else None
    info = request[info_key]
    info.tool = name if isinstance(name, str) else None
    if rule is None or rule.task is TaskMode.NEVER:
        return await relay()
    if not modern and "task" in params:
        if not await _serves_2025_tasks(request, "tools/call"):
            return await relay()  # the server's own SEP-1686 task, untouched
        # A SEP-1686 task request, and the server has no tasks of its own: the task is the proxy's.
        check_routing_headers(message, request.headers, required=False)
        info.mode = "sep1686"
        info.answers_2025 = True
        with _refusals():
            return await request.app[tasks2025_key].create(request, message, rule)
    if not modern and not declares_tasks(message) and rule.durable and wants_event_stream(request.headers):
        # A 2025-era client, which has no tasks of its own to wait with: a durable call. The proxy reads the body
        # here, so headers a gateway may have routed on must not say something else (SEP-2243).
        check_routing_headers(message, request.headers, required=False)
        info.mode = "durable"
        info.answers_2025 = True
        with _refusals():
            return await request.app[durable_key].start(request, message, rule)
    if modern or declares_tasks(message):
        # Before the capability check, as the reference ladder orders them: headers that disagree with the body
        # say nothing reliable about what the client wants.
        check_modern_request(message, request.headers)
    kept_alive = False
    if not declares_tasks(message):
        if rule.task is TaskMode.REQUIRED and not modern:
            # SEP-1686: a tool whose taskSupport is required, called without a task (and no durable call possible).
            raise JsonRpcError(
                METHOD_NOT_FOUND, f"Tool {name!r} runs only as a task: call it with params.task", http_status=200
            )
        if rule.task is TaskMode.REQUIRED:
            raise missing_tasks_capability(
                f"Tool {name!r} runs only as a task: declare the {TASKS_EXTENSION} extension in "
                '_meta["io.modelcontextprotocol/clientCapabilities"].extensions'
            )
        if not (modern and rule.durable and wants_event_stream(request.headers)):
            return await relay()
        kept_alive = True  # a 2026 client without tasks: the call as in a sync window, with a stream kept alive

    arguments = params.get("arguments")
    if arguments is not None and not isinstance(arguments, dict):
        raise JsonRpcError(INVALID_PARAMS, "Invalid params: arguments must be an object")
    forwarded = without_tasks_declaration(message)
    capabilities = meta_of(forwarded).get(META_CLIENT_CAPABILITIES)
    call = ToolCall(
        tool=name,
        message=forwarded,
        headers=request.headers.copy(),
        capabilities=capabilities if isinstance(capabilities, dict) else {},
        principal=request.app[identity_key].principal(request.headers),
        credential=request.app[identity_key].credential(request.headers),
        caller=request.app[identity_key].caller(request.headers, request.remote),
    )
    info.mode = "durable" if kept_alive else "task"
    with _refusals():
        if kept_alive:
            return await request.app[durable_key].kept_alive(request, message["id"], call, rule)
        outcome = await request.app[runner_key].submit(call, rule)
    if isinstance(outcome, TaskRecord):
        info.task_id = outcome.task_id
        return _json(result_response(message["id"], {**outcome.to_wire(), "resultType": "task"}))
    info.mode = "sync_window"
    return _direct_answer(message["id"], outcome)


@contextlib.contextmanager
def _refusals() -> Iterator[None]:
    """The runner's refusals of a new call (a full store, a limit) as the JSON-RPC error every caller gets."""
    try:
        yield
    except (StoreFullError, LimitReached) as exc:
        raise JsonRpcError(INTERNAL_ERROR, f"Cannot create a task: {exc}", getattr(exc, "data", None)) from exc


def _direct_answer(request_id: Any, outcome: DirectOutcome) -> web.Response:
    if outcome.result is not None:
        return _json(result_response(request_id, outcome.result))
    assert outcome.error is not None
    return _json(
        error_response(request_id, outcome.error), status=ERROR_HTTP_STATUS.get(outcome.error.get("code"), 200)
    )
