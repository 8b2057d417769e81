"""What the application and its request handlers share: the AppKeys of the app's resources, what a request's log
line reports (RequestInfo), the MCP endpoint's path, and a JSON reply."""

from __future__ import annotations

import dataclasses
from typing import Any

import structlog
from aiohttp import web

from ..clients.durable import DurableCalls
from ..clients.kept_alive import KeptAliveCalls
from ..clients.tasks2025 import Tasks2025
from ..clients.tasks2026 import Tasks2026
from ..clients.translated2025 import Translated2025
from ..jsonrpc import INTERNAL_ERROR, JsonRpcError, UpstreamError, dumps, error_object
from ..metrics import Metrics
from ..policy import LivePolicy
from ..security import HostGuard, Identity, PollGuard
from ..store.base import StoreUnavailable, TaskStore
from ..tasks.admission import ShuttingDown
from ..tasks.runner import TaskRunner
from ..upstream.bridge import SyncBridge
from ..upstream.gateway import Gateway
from .concurrency import Claim, Concurrency
from .rates import Rates

log = structlog.get_logger(__name__)

policy_key = web.AppKey("policy_key", LivePolicy)
store_key = web.AppKey("store_key", TaskStore)
runner_key = web.AppKey("runner_key", TaskRunner)
gateway_key = web.AppKey("gateway_key", Gateway)
bridge_key = web.AppKey("bridge_key", SyncBridge)
metrics_key = web.AppKey("metrics_key", Metrics)
identity_key = web.AppKey("identity_key", Identity)
guard_key = web.AppKey("guard_key", HostGuard)
rates_key = web.AppKey("rates_key", Rates)
concurrency_key = web.AppKey("concurrency_key", Concurrency)
local_paths_key = web.AppKey("local_paths_key", frozenset)
poll_guard_key = web.AppKey("poll_guard_key", PollGuard)
durable_key = web.AppKey("durable_key", DurableCalls)
kept_alive_key = web.AppKey("kept_alive_key", KeptAliveCalls)
tasks2025_key = web.AppKey("tasks2025_key", Tasks2025)
tasks2026_key = web.AppKey("tasks2026_key", Tasks2026)
translated_key = web.AppKey("translated_key", Translated2025)
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
    error_code: str = ""
    """The JSON-RPC error code the proxy answered with, when it answered one."""
    claim: Claim | None = None
    """The request's slots under the concurrency limits (proxy/front/concurrency.py): given back once it is
    answered, unless a background call took them over."""


info_key = web.RequestKey("info_key", RequestInfo)

MCP_PATH = "/mcp"


def json_reply(message: dict[str, Any], *, status: int = 200) -> web.Response:
    return web.Response(body=dumps(message), status=status, content_type="application/json")


def wire_error(exc: Exception) -> tuple[dict[str, Any], int] | None:
    """The JSON-RPC error object and HTTP status a handler's exception is answered with, wherever the request was
    served (app.py's error boundary, the lane); None for an exception that is a fault of the proxy's own."""
    if isinstance(exc, JsonRpcError | UpstreamError):
        return exc.to_error(), exc.http_status
    if isinstance(exc, StoreUnavailable):
        return error_object(INTERNAL_ERROR, f"Task store unavailable: {exc}"), 503
    if isinstance(exc, ShuttingDown):
        return error_object(INTERNAL_ERROR, f"Cannot create a task: {exc}"), 503
    return None


def log_request_handled(
    info: RequestInfo,
    *,
    principal: str | None,
    http_method: str,
    path: str,
    status: int,
    client_closed: bool,
    elapsed_s: float,
) -> None:
    """The one line a request writes when it is done (app.py's boundary and the lane's), at level info."""
    log.info(
        "request_handled",
        principal=principal,
        http_method=http_method,
        path=path,
        method=info.rpc_method,
        tool=info.tool,
        task_id=info.task_id,
        mode=info.mode,
        status=status,
        client_closed=client_closed,
        duration_ms=round(elapsed_s * 1000, 2),
    )
