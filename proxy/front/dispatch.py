"""POST /mcp and every other request to the MCP endpoint: what the proxy owns (tasks/*, task-creating and durable
tools/call, subscriptions/listen, discovery for a legacy upstream, SEP-1686 for 2025-era clients) is handled here,
anything else is relayed to the upstream as it is."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import structlog
from aiohttp import web
from multidict import MultiMapping

from .. import TASKS_EXTENSION
from ..clients import listen, tasks2025
from ..clients.durable import wants_event_stream
from ..clients.envelope import (
    check_batch_routing_headers,
    check_modern_request,
    check_reencodable,
    check_routing_headers,
    declares_tasks,
    is_modern,
    params_of,
    tool_name,
    upstream_body,
    without_tasks_declaration,
)
from ..clients.sessions2025 import FrontSession
from ..clients.tasks2026 import missing_tasks_capability
from ..config import ProxyConfig, TaskMode, ToolRule
from ..jsonrpc import (
    INVALID_PARAMS,
    INVALID_REQUEST,
    METHOD_NOT_FOUND,
    PARSE_ERROR,
    JsonRpcError,
    UpstreamError,
    classify,
    dumps,
    is_valid_id,
    loads,
    result_response,
)
from ..upstream.bridge import StreamReply
from ..upstream.era2025 import discover_result
from ..upstream.events import CredentialsNeeded, UpstreamUnavailable
from . import boundary
from .concurrency import Concurrency
from .context import (
    MCP_PATH,
    bridge_key,
    concurrency_key,
    durable_key,
    gateway_key,
    identity_key,
    info_key,
    json_reply,
    kept_alive_key,
    policy_key,
    rates_key,
    runner_key,
    store_key,
    tasks2025_key,
    tasks2026_key,
    translated_key,
)
from .creation import create, refusals, tool_call

log = structlog.get_logger(__name__)


async def handle_other(request: web.Request) -> web.StreamResponse:
    """GET, DELETE and any other path go to the upstream untouched (legacy GET streams, session DELETE, OAuth);
    a GET that resumes a durable call's stream (Last-Event-ID) is the proxy's. A path that may reach the upstream's
    MCP endpoint under another name is refused: it would pass by what the proxy checks there (scopes, limits)."""
    refused = _endpoint_in_disguise(request)
    if refused is not None:
        raise JsonRpcError(INVALID_REQUEST, f"Invalid request: {refused}; the MCP endpoint is {MCP_PATH}",
                           http_status=404)  # fmt: skip
    if request.method == "GET" and request.path == MCP_PATH and "Last-Event-ID" in request.headers:
        config = request.app[policy_key].config
        resumed = await request.app[durable_key].resume(request, config.rule_for)
        if resumed is not None:
            request[info_key].mode = "durable"
            return resumed
    if (
        request.app[gateway_key].translates_2025
        and request.path == MCP_PATH
        and request.method in ("GET", "DELETE")
        and "Mcp-Session-Id" in request.headers  # (a 2026 client's GET is the server's to answer)
    ):
        request[info_key].mode = "translated"
        return await request.app[translated_key].other(request)
    body = await read_body(request) if request.can_read_body else None
    return await request.app[gateway_key].relay.relay_other(request, body)


def _endpoint_in_disguise(request: web.Request) -> str | None:
    """Why a path other than the MCP endpoint's may be the endpoint to the upstream, or None: dot segments, encoded
    or doubled slashes (a client or the upstream may collapse them into /mcp), or the endpoint's own path in
    another case, with a trailing slash or parameters, or the upstream's endpoint path when it is not /mcp."""
    raw = request.raw_path.partition("?")[0]
    if "://" in raw[:12]:  # the absolute form: its path
        raw = "/" + raw.partition("://")[2].partition("/")[2]
    lowered = raw.lower()
    if "//" in raw or "\\" in raw or any(code in lowered for code in ("%2e", "%2f", "%5c")):
        return "a path with an encoded or doubled slash or dot"
    if any(segment in (".", "..") for segment in raw.split("/")):
        return "a path with dot segments"
    plain = request.path.partition(";")[0].rstrip("/").lower()
    upstream = request.app[policy_key].config.upstream
    endpoints = {MCP_PATH}
    if upstream.url is not None:
        endpoints.add((upstream.url.path or "/").rstrip("/").lower())
    if plain in endpoints and request.path != MCP_PATH:
        return "another spelling of the MCP endpoint's path"
    return None


async def handle_mcp_post(request: web.Request) -> web.StreamResponse:
    app = request.app
    info = request[info_key]
    body = await read_body(request, app)
    try:
        message = loads(body)
    except ValueError as exc:
        raise JsonRpcError(PARSE_ERROR, f"Parse error: the request body is not valid JSON ({exc})") from None
    kind = classify(message)
    if kind == "invalid":
        if isinstance(message, dict) and is_valid_id(message.get("id")):
            info.jsonrpc_id = message["id"]
        raise JsonRpcError(
            INVALID_REQUEST,
            'Invalid request: expected a JSON-RPC 2.0 object with "jsonrpc": "2.0", a string method, '
            "object params and a string or integer id",
        )
    if kind == "request":  # known before any refusal below: its answer carries the id, its log line the method
        info.jsonrpc_id = message["id"]
        info.rpc_method = message["method"]
        info.tool = tool_name(message)
    verifier = app[identity_key].verifier
    if verifier is not None and kind in ("request", "notification", "batch"):
        refused = boundary.scopes_refusal(verifier.cached(request.headers), message, app[policy_key].config.rule_for)
        if refused is not None:
            raise refused
    if boundary.limited(app[rates_key], app[concurrency_key]):
        await boundary.apply_limits(app[rates_key], app[concurrency_key], app[identity_key], request.headers, message,
                                    request.remote, info, app[policy_key].config.rule_for)  # fmt: skip
    if kind != "request":
        return await _not_a_request(request, kind, message, body)
    method = message["method"]
    boundary.trace(info, request.headers, message)
    config = app[policy_key].config
    way = route(message, request.headers, config, config.rule_for)
    # Every way but None says the era: "as_is" is a 2025-era client's request, the others a 2026 client's.
    modern = is_modern(message, request.headers) if way is None else way != "as_is"
    if not modern and await _translating(request):
        return await _translated(request, message, body)
    if way == "tasks":
        info.mode = "local"
        answer = await app[tasks2026_key].handle(request.headers, message, info)
        return json_reply(result_response(message["id"], answer))
    if way == "create":
        rule = config.rule_for(message["params"]["name"])
        assert rule is not None
        runner = app[runner_key]
        counted = runner.precedence.counts(rule, message["params"])  # (the lane counts from the read)
        if counted:
            runner.precedence.begin()
        try:
            answer, status = await create(runner, app[identity_key], message, request.headers, body, request.remote,
                                          rule, info)  # fmt: skip
        finally:
            if counted:
                runner.precedence.end()
        return json_reply(answer, status=status)
    if way is not None:
        return await _relay(request, message, body, modern=way == "relay")
    if method == "tools/call":
        # The era is not needed up front: a task learns it in the background, a pass-through call in _relay.
        return await _tools_call(request, message, body, modern=modern)
    if not modern and method in _SEP1686_ANNOUNCED and await _serves_2025_tasks(request, method):
        return await _sep1686(request, message, body, method)
    if method == "subscriptions/listen" and modern:
        return await _listen(request, message, body)
    if method == "server/discover":
        if modern and await _era(request) == "legacy":
            return await _discover_from_legacy(request, message)
        limit = app[policy_key].config.limits.max_result_bytes
        body = upstream_body(message, body) if modern else body
        return await app[gateway_key].relay.relay_rewritten(request, body, message["id"], _advertise_tasks, limit=limit)
    return await _relay(request, message, body, modern=modern)


def route(
    message: dict[str, Any], headers: MultiMapping[str], config: ProxyConfig, rule_for: Callable[[str], ToolRule | None]
) -> str | None:
    """The way a parsed JSON-RPC request to the MCP endpoint goes, when it is one that needs nothing of aiohttp's
    (handle_mcp_post and the lane both take it from here, proxy/front/lane/routing.py):
    - "tasks": a 2026 client's tasks/* (Tasks2026.handle);
    - "create": a 2026 client's tools/call that declares tasks, of a tool a rule runs as a task (`create`);
    - "relay": a 2026 request the proxy does not own, relayed (without a tasks declaration) or bridged to a 2025-era
      upstream: not tasks/*, subscriptions/listen or server/discover, and for tools/call a tool no rule runs as a
      task;
    - "as_is": a 2025-era client's request the proxy does not own, relayed untouched: not server/discover, and no
      method SEP-1686 may make the proxy's while the policy runs a tool as a task.
    None for any other (notifications, responses and batches never come here): handle_mcp_post's own handlers.
    `rule_for`: the policy's rules (the lane's looks up the one its head named once)."""
    method = message["method"]
    if not is_modern(message, headers):
        if method == "server/discover":
            return None
        owned = method in _SEP1686_METHODS and any(rule.task is not TaskMode.NEVER for rule in config.tools)
        return None if owned else "as_is"
    if method.startswith("tasks/"):
        return "tasks"
    if method in ("subscriptions/listen", "server/discover"):
        return None
    if method != "tools/call":
        return "relay"
    name = params_of(message).get("name")
    rule = rule_for(name) if isinstance(name, str) else None
    if rule is None or rule.task is TaskMode.NEVER:
        return "relay"
    return "create" if declares_tasks(message) else None


async def _relay(request: web.Request, message: dict[str, Any], body: bytes, *, modern: bool) -> web.StreamResponse:
    """Carry a request the proxy does not own synchronously, the way the upstream's era needs."""
    if modern and await _era(request) == "legacy":
        # The proxy reads this body to translate it; a legacy upstream cannot check the 2026 headers itself.
        check_modern_request(message, request.headers)
        check_reencodable(message, body)
        request[info_key].mode = "legacy"
        return await request.app[bridge_key].relay(request.headers, message, StreamReply(request))
    # Routing headers must not say something the body does not (SEP-2243), in any copy: a gateway in front may
    # have routed on any of them, and a server may check only the first (or, of 2025, none).
    check_routing_headers(message, request.headers, required=False)
    body = upstream_body(message, body) if modern else body
    return await request.app[gateway_key].relay.relay(request, body, message, request_id=message["id"])


async def _not_a_request(request: web.Request, kind: str, message: Any, body: bytes) -> web.StreamResponse:
    """Notifications, responses and batches: the proxy's when they answer or cancel what it relayed, else the
    server's."""
    app = request.app
    if kind == "notification":
        # Routing headers, a request's or not, must not say something the body does not: a gateway may route on them.
        check_routing_headers(message, request.headers, required=False)
    elif kind == "batch":
        check_batch_routing_headers(message, request.headers)
    if kind == "response":
        # A client's answer to a request a durable call's stream relayed is the proxy's; any other is the server's.
        info = request[info_key]
        info.answers_2025 = not is_modern(message, request.headers)
        answered = await app[durable_key].answer(request, message)
        info.answers_2025 = False  # answered, or not the proxy's to answer: it goes to the server
        if answered is not None:
            info.mode = "durable"
            return answered
    elif _is_legacy_cancel(kind, message, request) and await app[durable_key].cancelled(request, message):
        request[info_key].mode = "durable"
        return web.Response(status=202)
    if app[gateway_key].translates_2025 and not (kind != "batch" and is_modern(message, request.headers)):
        # A 2025 session of the proxy's: the server, 2026-07-28 only, has nothing to hear of it.
        if kind == "batch":
            raise JsonRpcError(INVALID_REQUEST, "Invalid request: this server speaks 2026-07-28 only, and the proxy "
                               "takes no JSON-RPC batches for it", http_status=200)  # fmt: skip
        request[info_key].mode = "translated"
        app[translated_key].notified(request, message)
        return web.Response(status=202)
    # Notifications, responses to a legacy server's requests, and legacy batches are not the proxy's.
    return await app[gateway_key].relay.relay(request, body, message)


async def _sep1686(request: web.Request, message: dict[str, Any], body: bytes, method: str) -> web.StreamResponse:
    """SEP-1686 for 2025-era clients, for the tools the policy names: the proxy's tasks, and what announces them."""
    config = request.app[policy_key].config
    relay_to = request.app[gateway_key].relay
    limit = config.limits.max_result_bytes
    if method == "initialize":
        # Without credentials and without a session, callers cannot be told apart: no tasks/list for them.
        anonymous = [not request.app[identity_key].principal(request.headers)]

        def sessions(headers: Any) -> None:
            anonymous[0] = anonymous[0] and "Mcp-Session-Id" not in headers

        def advertise(result: dict[str, Any]) -> None:
            tasks2025.advertise(result, anonymous=anonymous[0])

        return await relay_to.relay_rewritten(request, body, message["id"], advertise, limit=limit, on_headers=sessions)
    if method == "tools/list":

        def mark(result: dict[str, Any]) -> None:
            tasks2025.mark_tools(result, config.rule_for)

        return await relay_to.relay_rewritten(request, body, message["id"], mark, limit=limit)
    info = request[info_key]
    info.mode = "sep1686"
    info.answers_2025 = True
    return await request.app[tasks2025_key].handle(request, message, config.rule_for)


def _is_legacy_cancel(kind: str, message: Any, request: web.Request) -> bool:
    return (
        kind == "notification"
        and message["method"] == "notifications/cancelled"
        and not is_modern(message, request.headers)
    )


async def _listen(request: web.Request, message: dict[str, Any], body: bytes) -> web.StreamResponse:
    """subscriptions/listen: task notifications are the proxy's, every other kind the upstream's (merged)."""
    params = params_of(message)
    task_ids, rest = listen.parse_filter(params)
    relay_to = request.app[gateway_key].relay
    if task_ids is None:
        return await relay_to.relay(request, upstream_body(message, body), message, request_id=message["id"])
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
                await legacy.sessions.session_for(request.headers)
            except (UpstreamUnavailable, ConnectionError, OSError) as exc:
                raise UpstreamError(f"cannot open a session upstream ({exc})", upstream=legacy.url) from exc
        return not tasks2025.has_tool_tasks(legacy.initialize_result or {})
    return True  # a 2026-07-28 server has no SEP-1686 tasks of its own


async def _translating(request: web.Request) -> bool:
    """Whether a 2025-era client's request is translated for a server that speaks 2026-07-28 only (learnt once)."""
    gateway = request.app[gateway_key]
    if gateway.passes_2025_as_is:
        return False
    if gateway.translates_2025:
        return True
    try:
        return await gateway.translating(request.headers)
    except CredentialsNeeded:
        return False  # nothing learnt: the request goes as it came, and the server's challenge reaches the client
    except UpstreamUnavailable as exc:
        raise UpstreamError(exc.args[0], upstream=gateway.url) from exc


UNRULED = ToolRule(match="*", task=TaskMode.NEVER)
"""The rule of a tool the policy does not name, called by a 2025-era client of a 2026-07-28-only server: a durable
call with the defaults, the one way the proxy can carry the server's questions to that client."""


async def _translated(request: web.Request, message: dict[str, Any], body: bytes) -> web.StreamResponse:
    """A 2025-era client's request in front of a server that speaks 2026-07-28 only (clients/translated2025.py):
    its session is the proxy's, its calls run as durable calls (or SEP-1686 tasks), the rest is translated."""
    app = request.app
    config = app[policy_key].config
    translated = app[translated_key]
    info = request[info_key]
    info.mode = "translated"
    method = message["method"]
    check_reencodable(message, body)  # what goes upstream is encoded again, in the 2026 envelope
    tasks = any(rule.task is not TaskMode.NEVER for rule in config.tools)
    if method == "initialize":
        if not tasks:
            return await translated.initialize(request, message)
        # Its own session tells an anonymous caller's tasks from others': tasks/list is offered.
        return await translated.initialize(request, message, lambda r: tasks2025.advertise(r, anonymous=False))
    front = translated.front(request)
    with translated.in_flight(front, request, message["id"]):  # DELETE and notifications/cancelled end it
        return await _translated_request(request, message, front, tasks)


async def _translated_request(
    request: web.Request, message: dict[str, Any], front: FrontSession, tasks: bool
) -> web.StreamResponse:
    app = request.app
    config = app[policy_key].config
    translated = app[translated_key]
    info = request[info_key]
    method = message["method"]
    sep1686 = tasks and front.protocol_version == tasks2025.VERSION
    if method == "tools/call":
        params = params_of(message)
        name = params.get("name")
        if not isinstance(name, str):
            raise JsonRpcError(INVALID_PARAMS, "Invalid params: tools/call needs a string name", http_status=200)
        rule = config.rule_for(name)
        check_routing_headers(message, request.headers, required=False)
        info.answers_2025 = True
        if "task" in params and sep1686 and rule is not None and rule.task is not TaskMode.NEVER:
            info.mode = "sep1686"
            with refusals():
                return await app[tasks2025_key].create(request, message, rule, info.claim)
        if "task" in params:  # a task the proxy did not offer for this tool: the call, as a durable one
            message = {**message, "params": {key: value for key, value in params.items() if key != "task"}}
        info.mode = "durable"
        with refusals():
            return await app[durable_key].start(request, message, rule or UNRULED, info.claim)
    if method in tasks2025.METHODS and sep1686:
        info.mode = "sep1686"
        info.answers_2025 = True
        return await app[tasks2025_key].handle(request, message, config.rule_for)
    if method == "tools/list" and sep1686:
        return await translated.request(request, message, front, lambda r: tasks2025.mark_tools(r, config.rule_for))
    return await translated.request(request, message, front)


async def _era(request: web.Request) -> str:
    gateway = request.app[gateway_key]
    known = gateway.known_era
    if known is not None:
        return known  # once learnt, it stays: no probe, no lock
    try:
        return await gateway.era(request.headers)
    except UpstreamUnavailable as exc:
        raise UpstreamError(exc.args[0], upstream=request.app[gateway_key].url) from exc


async def _discover_from_legacy(request: web.Request, message: dict[str, Any]) -> web.Response:
    """server/discover for a legacy upstream, which has none: answered from its initialize result (NOTES §8)."""
    request[info_key].mode = "legacy"
    check_modern_request(message, request.headers)
    legacy = request.app[gateway_key].legacy
    try:
        await legacy.sessions.session_for(request.headers)
    except (UpstreamUnavailable, ConnectionError, OSError) as exc:
        raise UpstreamError(f"cannot open a session upstream ({exc})", upstream=legacy.url) from exc
    return json_reply(result_response(message["id"], discover_result(legacy.initialize_result)))


async def read_body(request: web.Request, app: web.Application | None = None) -> bytes:
    config = (app or request.app)[policy_key].config
    limit = config.limits.max_body_bytes
    try:
        if request.content.is_eof():
            return await request.read()  # all of it arrived with the head (most requests): nothing to wait for
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
    body: bytes,
    *,
    modern: bool,
) -> web.StreamResponse:
    """A tools/call `route` leaves here: a 2025 client's (a SEP-1686 task, a durable call, or relayed), or a 2026
    client's that declares no tasks, of a tool a rule runs as a task (a kept-alive call, a refusal, or relayed)."""
    config = request.app[policy_key].config
    params = params_of(message)
    name = params.get("name")
    rule = config.rule_for(name) if isinstance(name, str) else None
    info = request[info_key]

    async def relay() -> web.StreamResponse:
        await Concurrency.hold(info.claim)  # not a background call after all
        return await _relay(request, message, body, modern=modern)

    if rule is None or rule.task is TaskMode.NEVER:
        return await relay()
    if not modern and "task" in params:
        if not await _serves_2025_tasks(request, "tools/call"):
            return await relay()  # the server's own SEP-1686 task, untouched
        # A SEP-1686 task request, and the server has no tasks of its own: the task is the proxy's.
        check_routing_headers(message, request.headers, required=False)
        info.mode = "sep1686"
        info.answers_2025 = True
        check_reencodable(message, body)  # its call goes upstream encoded again
        with refusals():
            return await request.app[tasks2025_key].create(request, message, rule, info.claim)
    if not modern and not declares_tasks(message) and rule.durable and wants_event_stream(request.headers):
        # A 2025-era client, which has no tasks of its own to wait with: a durable call. The proxy reads the body
        # here, so headers a gateway may have routed on must not say something else (SEP-2243).
        check_routing_headers(message, request.headers, required=False)
        info.mode = "durable"
        info.answers_2025 = True
        check_reencodable(message, body)  # its call goes upstream encoded again
        with refusals():
            return await request.app[durable_key].start(request, message, rule, info.claim)
    if modern or declares_tasks(message):
        # Before the capability check, as the reference ladder orders them: headers that disagree with the body
        # say nothing reliable about what the client wants. (A 2025 request that declares tasks fails it: a
        # 2026 one that does took `route`'s "create".)
        check_modern_request(message, request.headers)
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
    # A 2026 client without tasks: the call as in a sync window, with a stream kept alive.
    check_reencodable(message, body)  # the call goes upstream encoded again, from the background
    info.mode = "kept_alive"
    call, key = tool_call(message, request.headers, request.remote, request.app[identity_key], info.claim)
    with refusals():
        return await request.app[kept_alive_key].serve(request, message, call, rule, key)
