"""What every request gets, whichever reader took it (the lane, proxy/front/lane/, or aiohttp's server,
proxy/front/app.py): a usable request id on its log lines, the Host/Origin guard, its span, its failures as JSON-RPC
errors, and its metrics and log line once it is answered. Written once, so that a check added here applies to every
request."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import structlog
from multidict import MultiMapping

from .. import tracing
from ..clients.envelope import tool_name
from ..config import TaskMode, ToolRule
from ..jsonrpc import INTERNAL_ERROR, INVALID_REQUEST, UpstreamError, dumps, error_object
from ..log import bind_request_id
from ..metrics import Metrics, method_label
from ..policy import LivePolicy
from ..security import HostGuard, Identity, caller_of
from ..tokens import Caller, TokenRefused, TokenVerifier, missing_scopes
from .concurrency import Concurrency
from .context import RequestInfo, log_request_handled, wire_error
from .rates import Rates

log = structlog.get_logger(__name__)

VERBOSE_LEVELS = frozenset({"debug", "info"})
_INTERNAL = error_object(INTERNAL_ERROR, "Internal error in the proxy")
_MAX_REQUEST_ID = 128


def bind_request(headers: MultiMapping[str] | None) -> None:
    """The client's X-Request-Id on every log line of this request, when it is short, printable ASCII."""
    value = headers.get("X-Request-Id") if headers is not None else None
    usable = value is not None and 0 < len(value) <= _MAX_REQUEST_ID and value.isascii() and value.isprintable()
    bind_request_id(value if usable else None)


def refused_by_guard(guard: HostGuard, headers: MultiMapping[str]) -> tuple[dict[str, Any], int] | None:
    """A Host or Origin the policy does not allow (DNS rebinding): the error and status, before anything else runs."""
    if not guard.host_allowed(headers.get("Host")):
        return error_object(INVALID_REQUEST, "Invalid Host header (security.allowed_hosts)"), 421
    if not guard.origin_allowed(headers.get("Origin")):
        return error_object(INVALID_REQUEST, "Origin not allowed (security.allowed_origins)"), 403
    return None


def token_refusal(
    refused: TokenRefused, verifier: TokenVerifier, info: RequestInfo, metrics: Metrics
) -> tuple[bytes, int, dict[str, str]]:
    """A request refused for its credential (principal: jwt), counted: its body (RFC 6750's error, as the MCP SDKs
    answer one), status and WWW-Authenticate challenge, which names the Protected Resource Metadata."""
    metrics.errors.labels(str(refused.status)).inc()
    info.mode = "local"
    body = {"error": refused.error or "invalid_request", "error_description": refused.description}
    return dumps(body), refused.status, {"WWW-Authenticate": verifier.challenge(refused)}


def scopes_refusal(
    caller: Caller | None, message: Any, rule_for: Callable[[str], ToolRule | None]
) -> TokenRefused | None:
    """The 403 for a tools/call (or one in a batch, or a notification) that names a tool whose rule needs scopes
    the caller's token lacks; None when it needs none it lacks. Both readers ask it: the application raises the
    refusal, the lane leaves such a request to the application. `caller`: the token's, verified at the front door
    (None: it expired meanwhile, a 401)."""
    needed: list[str] = []
    for call in message if isinstance(message, list) else [message]:
        name = tool_name(call)
        rule = rule_for(name) if name is not None else None
        if rule is not None:
            needed += [scope for scope in rule.scopes if scope not in needed]
    if not needed:
        return None
    if caller is None:
        return TokenRefused(401, "invalid_token", "The token has expired")
    return missing_scopes(caller, needed)


def allowed_on_lane(verifier: TokenVerifier | None, headers: MultiMapping[str]) -> Caller | bool:
    """Whether the lane may serve a request as far as its credential goes: no verification configured, or a token
    verified before and not expired. Anything else (no token, a new one, one to refuse) is the application's, which
    verifies it (fetching the issuer's keys if need be) or answers the refusal."""
    if verifier is None:
        return True
    try:
        return verifier.cached(headers) or False
    except TokenRefused:
        return False


def retry_after(exc: Exception) -> str | None:
    """The Retry-After of a refusal that says when to come back (a rate limit's), in whole seconds."""
    wait = getattr(exc, "retry_after_s", None)
    return str(max(1, math.ceil(wait))) if isinstance(wait, float | int) else None


def limited(rates: Rates, concurrency: Concurrency) -> bool:
    """Whether limits.rates holds any limit for `apply_limits` to apply (both readers ask before any other work)."""
    return rates.configured or concurrency.configured


async def apply_limits(
    rates: Rates,
    concurrency: Concurrency,
    identity: Identity,
    headers: MultiMapping[str],
    messages: Any,
    remote: Any,
    info: RequestInfo,
    rule_for: Callable[[str], ToolRule | None],
) -> None:
    """limits.rates for the request's messages, the caller found once for both kinds: counted against the rates
    (RateLimited past one), then its calls' slots under the concurrency limits taken, refused or waited for. A call
    that may go on in the background (a rule runs its tool) takes its slots as its background call starts
    (Claim.admit: never for a retry that finds its call running, by idempotency key or input round), or in
    dispatch's `_tools_call` when it is answered directly after all. Given back once the request is answered
    (`done`), unless a background call took them over."""
    caller = caller_of(identity.principal(headers), remote)
    if rates.configured:
        await rates.check(messages, caller)
    claim = concurrency.claim(messages, caller) if concurrency.configured else None
    if claim is None:
        return
    info.claim = claim
    name = tool_name(messages)  # (a batch's calls never go on in the background)
    rule = rule_for(name) if name is not None else None
    if rule is None or rule.task is TaskMode.NEVER:
        await concurrency.enter(claim)


def trace(info: RequestInfo, headers: MultiMapping[str], message: dict[str, Any]) -> None:
    """Open the request's span, once its JSON-RPC request is parsed (tracing on; else one attribute check)."""
    if not tracing.TRACER.enabled:
        return
    method = message["method"]
    params = message.get("params")
    tool = params.get("name") if method == "tools/call" and isinstance(params, dict) else None
    info.trace = tracing.TRACER.begin_request(headers, message, method, tool if isinstance(tool, str) else None)


def refusal(error: dict[str, Any], status: int, info: RequestInfo, metrics: Metrics) -> tuple[dict[str, Any], int]:
    """An error the proxy answers itself, counted; a 2025-era client's on HTTP 200 (its SDKs end the whole session
    on a 4xx or 5xx to a request of theirs)."""
    info.error_code = str(error.get("code"))
    metrics.errors.labels(info.error_code).inc()
    if info.mode == "passthrough":
        info.mode = "local"
    return error, 200 if info.answers_2025 else status


def failure(
    exc: Exception, info: RequestInfo, metrics: Metrics, *, client_gone: bool
) -> tuple[dict[str, Any], int, bool] | None:
    """How a request whose handling raised `exc` is answered: its JSON-RPC error, HTTP status, and whether it was a
    fault of the proxy's own (logged with its traceback; the client sees only "Internal error"). None when the
    client has gone and nobody is left to answer (the caller counts 499)."""
    if isinstance(exc, UpstreamError):
        log.warning("upstream_error", reason=exc.reason)
        metrics.upstream_errors.labels("request").inc()
    wired = wire_error(exc)
    if wired is not None:
        return (*refusal(*wired, info, metrics), False)
    if isinstance(exc, ConnectionResetError) and client_gone:
        return None  # a write to a client that has gone away: not a fault
    log.exception("unhandled_error", exc_info=exc)
    return (*refusal(_INTERNAL, 200, info, metrics), True)


def done(
    info: RequestInfo,
    *,
    policy: LivePolicy,
    metrics: Metrics,
    identity: Identity,
    headers: MultiMapping[str] | None,
    http_method: str,
    path: str,
    status: int,
    started: float,
) -> None:
    """The request is answered (or its client left: 499): its slots are given back (unless a background call took
    them over), its span ends, its metrics and its log line."""
    if info.claim is not None and not info.claim.passed:
        info.claim.release()
    if info.trace is not None:
        tracing.TRACER.end_request(  # type: ignore[union-attr]
            info.trace, status=status, task_id=info.task_id, task_trace=info.task_trace, mode=info.mode
        )
    elapsed_s = time.perf_counter() - started
    operation = None
    if info.rpc_method is not None:  # a JSON-RPC request (not a GET, a DELETE, a notification or a batch)
        # Who may call, and how much, by HTTP status; any other error by the JSON-RPC code answered, else the status.
        error_type = info.error_code or (str(status) if status >= 400 else "")
        if status in (401, 403, 429):
            error_type = str(status)
        version = headers.get("MCP-Protocol-Version", "") if headers is not None else ""
        operation = (info.tool or "", error_type, version)
    metrics.observe_request(method_label(info.rpc_method), info.mode, status, elapsed_s, operation)
    if policy.config.logging.level in VERBOSE_LEVELS:  # spare the work when not logged
        log_request_handled(
            info,
            principal=identity.logged_principal(headers) if headers is not None else None,
            http_method=http_method,
            path=path,
            status=status,
            client_closed=status == 499,
            elapsed_s=elapsed_s,
        )
