"""The 2026-07-28 request envelope: `_meta` protocol version and client capabilities, and the Mcp-* headers."""

from __future__ import annotations

import base64
import copy
from typing import Any

from multidict import CIMultiDict, MultiMapping

from .. import PROTOCOL_VERSION, TASKS_EXTENSION
from ..jsonrpc import (
    HEADER_MISMATCH,
    INVALID_PARAMS,
    INVALID_REQUEST,
    MAX_DUMPS_DEPTH,
    UNSUPPORTED_PROTOCOL_VERSION,
    JsonRpcError,
    dumps,
    too_deep,
)

META_PROTOCOL_VERSION = "io.modelcontextprotocol/protocolVersion"
META_CLIENT_CAPABILITIES = "io.modelcontextprotocol/clientCapabilities"
SUPPORTED_VERSIONS = (PROTOCOL_VERSION,)
TASK_METHODS = frozenset({"tasks/get", "tasks/update", "tasks/cancel"})
NAME_PARAMS = {
    "tools/call": "name",
    "prompts/get": "name",
    "resources/read": "uri",
    **dict.fromkeys(TASK_METHODS, "taskId"),
}
"""The body field each method's `Mcp-Name` header mirrors (SEP-2243; SEP-2663 for tasks/*)."""


def params_of(message: dict[str, Any]) -> dict[str, Any]:
    params = message.get("params")
    return params if isinstance(params, dict) else {}


def tool_name(message: Any) -> str | None:
    """The tool a tools/call names (a string), else None: any other message, or a name that is not text."""
    if not isinstance(message, dict) or message.get("method") != "tools/call":
        return None
    params = message.get("params")
    name = params.get("name") if isinstance(params, dict) else None
    return name if isinstance(name, str) else None


def meta_of(message: dict[str, Any]) -> dict[str, Any]:
    meta = params_of(message).get("_meta")
    return meta if isinstance(meta, dict) else {}


def without_meta_key(result: dict[str, Any], key: str) -> dict[str, Any]:
    """`result` without `key` in its `_meta` (and without `_meta` once empty); `result` itself when it has none."""
    meta = result.get("_meta")
    if not (isinstance(meta, dict) and key in meta):
        return result
    meta = {name: value for name, value in meta.items() if name != key}
    return {**result, "_meta": meta} if meta else {name: value for name, value in result.items() if name != "_meta"}


def progress_token(message: dict[str, Any]) -> str | int | None:
    """The request's `_meta.progressToken`, when it is one (a string or an integer)."""
    token = meta_of(message).get("progressToken")
    return token if isinstance(token, str | int) and not isinstance(token, bool) else None


def is_modern(message: dict[str, Any], headers: MultiMapping[str]) -> bool:
    """Whether the request speaks 2026-07-28 (or later); a legacy request's tasks/* belong to the upstream."""
    if META_PROTOCOL_VERSION in meta_of(message):
        return True
    version = headers.get("MCP-Protocol-Version", "").strip()
    return version[:4].isdigit() and version >= "2026"


def declares_tasks(message: dict[str, Any]) -> bool:
    """SEP-2663: the extension counts only when this very request declares it in its own _meta."""
    capabilities = meta_of(message).get(META_CLIENT_CAPABILITIES)
    if not isinstance(capabilities, dict):
        return False
    extensions = capabilities.get("extensions")
    return isinstance(extensions, dict) and TASKS_EXTENSION in extensions


def check_modern_request(message: dict[str, Any], headers: MultiMapping[str]) -> None:
    """The validation a 2026-07-28 request gets before the proxy acts on its body, in the reference SDK's order:
    the envelope's version key, then the SEP-2243 headers against the body, then the version itself."""
    meta = meta_of(message)
    if META_PROTOCOL_VERSION not in meta:
        raise JsonRpcError(INVALID_PARAMS, f"Missing required _meta key {META_PROTOCOL_VERSION}")
    requested = meta[META_PROTOCOL_VERSION]
    _check_header(headers, "MCP-Protocol-Version", requested, required=True)
    check_routing_headers(message, headers, required=True)
    if requested not in SUPPORTED_VERSIONS:
        raise JsonRpcError(
            UNSUPPORTED_PROTOCOL_VERSION,
            "Unsupported protocol version",
            {"supported": list(SUPPORTED_VERSIONS), "requested": str(requested)},
        )


def check_routing_headers(message: dict[str, Any], headers: MultiMapping[str], *, required: bool) -> None:
    """SEP-2243: `Mcp-Method` equals the body's method and `Mcp-Name` the tool or prompt name, resource URI or task
    id. `required` makes a missing header an error too, except `Mcp-Name` on tasks/*, which one real tasks client
    (fastmcp-tasks) omits; without it only headers that are present are compared (a legacy request)."""
    method = message["method"]
    _check_header(headers, "Mcp-Method", method, required=required)
    name_key = NAME_PARAMS.get(method)
    if name_key is None:
        return
    value = params_of(message).get(name_key)
    if isinstance(value, str):
        _check_header(headers, "Mcp-Name", value, required=required and method not in TASK_METHODS, encoded=True)


def _check_header(
    headers: MultiMapping[str], name: str, body_value: Any, *, required: bool, encoded: bool = False
) -> None:
    copies = headers.getall(name, ())
    if not copies:
        if required:
            raise JsonRpcError(
                HEADER_MISMATCH, f"Header mismatch: the {name} header is missing; the body's value is {body_value!r}"
            )
        return
    # Every copy: a gateway in front may have routed on any of them (a true first copy and a lying second one).
    for raw in copies:
        value = decode_header_value(raw) if encoded else raw.strip()
        if value is None:
            raise JsonRpcError(
                HEADER_MISMATCH, f"Header mismatch: {name} header value {raw.strip()!r} is not canonical Base64 UTF-8"
            )
        if value != body_value:
            raise JsonRpcError(
                HEADER_MISMATCH,
                f"Header mismatch: {name} header value {raw.strip()!r} does not match body value {body_value!r}",
            )


def decode_header_value(value: str) -> str | None:
    """Undo the `=?base64?...?=` encoding of Mcp-Name / Mcp-Param-* values; None when the Base64 is invalid or not
    canonical (padding bits set, as in `YWJ=`: one name would have several spellings, as the reference SDK refuses)."""
    value = value.strip()
    if value.startswith("=?base64?") and value.endswith("?="):
        payload = value[len("=?base64?") : -2]
        try:
            decoded = base64.b64decode(payload, validate=True)
            if base64.b64encode(decoded).decode() != payload:
                return None
            return decoded.decode("utf-8")
        except ValueError:  # binascii.Error, UnicodeDecodeError, and a payload that is not ASCII
            return None
    return value


def encode_header_value(value: str) -> str:
    """A value for Mcp-Name / Mcp-Param-*: as it is when it is visible ASCII without surrounding spaces, else
    `=?base64?...?=` (SEP-2243), which decode_header_value undoes."""
    if value and value.isascii() and value.isprintable() and value.strip() == value:
        return value
    return "=?base64?" + base64.b64encode(value.encode("utf-8", "surrogatepass")).decode() + "?="


HEADER_PARAM = "x-mcp-header"
_HEADER_PARAM_TYPES = frozenset({"string", "integer", "boolean"})


def header_params(input_schema: Any) -> dict[tuple[str, ...], str]:
    """A tool's `Mcp-Param-*` parameters (SEP-2243): each property path, reached through `properties` alone, whose
    string, integer or boolean property carries an `x-mcp-header` token, to that token."""
    found: dict[tuple[str, ...], str] = {}
    stack: list[tuple[tuple[str, ...], Any]] = [((), input_schema)]
    while stack:  # (no recursion: a schema may nest deep)
        path, schema = stack.pop()
        properties = schema.get("properties") if isinstance(schema, dict) else None
        if not isinstance(properties, dict):
            continue
        for name, sub in properties.items():
            if not isinstance(sub, dict):
                continue
            token = sub.get(HEADER_PARAM)
            if isinstance(token, str) and token and sub.get("type") in _HEADER_PARAM_TYPES:
                found[(*path, name)] = token
            stack.append(((*path, name), sub))
    return found


def param_headers(params: dict[tuple[str, ...], str], arguments: Any) -> dict[str, str]:
    """The `Mcp-Param-*` headers a tools/call's arguments give (`params`: header_params of its tool): a value that
    is present and not null, a boolean as true/false, a number in decimal, each encoded as encode_header_value."""
    headers: dict[str, str] = {}
    for path, token in params.items():
        value: Any = arguments
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        if isinstance(value, bool):
            rendered = "true" if value else "false"
        elif isinstance(value, float) and value.is_integer():
            rendered = str(int(value))  # an integer sent as 42.0 compares equal to 42
        elif isinstance(value, int | float | str):
            rendered = str(value)
        else:
            continue
        headers[f"Mcp-Param-{token}"] = encode_header_value(rendered)
    return headers


def check_batch_routing_headers(messages: list[Any], headers: MultiMapping[str]) -> None:
    """A batch (2025-03-26) under one set of headers: routing headers that are present must hold for every request
    and notification in it, as they would for each alone. Copies that all say the same are compared once per item,
    not each of them (a head may hold about 128, a batch hundreds of thousands of items); copies that disagree fail
    at the first item they apply to, as before."""
    routing: CIMultiDict[str] = CIMultiDict()
    for name, encoded in (("Mcp-Method", False), ("Mcp-Name", True)):
        copies = headers.getall(name, ())
        said = {decode_header_value(copy) if encoded else copy.strip() for copy in copies}
        routing.extend((name, copy) for copy in (copies if len(said) > 1 else copies[:1]))
    if not routing:
        return
    for message in messages:
        if isinstance(message, dict) and isinstance(message.get("method"), str):
            check_routing_headers(message, routing, required=False)


def without_tasks_declaration(message: dict[str, Any]) -> dict[str, Any]:
    """A copy of the request for the upstream: no tasks extension in _meta and no legacy params.task opt-in."""
    forwarded = copy.copy(message)
    params = dict(params_of(message))
    params.pop("task", None)
    meta = params.get("_meta")
    if isinstance(meta, dict) and isinstance(meta.get(META_CLIENT_CAPABILITIES), dict):
        capabilities = dict(meta[META_CLIENT_CAPABILITIES])
        extensions = capabilities.get("extensions")
        if isinstance(extensions, dict) and TASKS_EXTENSION in extensions:
            extensions = {key: value for key, value in extensions.items() if key != TASKS_EXTENSION}
            if extensions:
                capabilities["extensions"] = extensions
            else:
                del capabilities["extensions"]
        params["_meta"] = {**meta, META_CLIENT_CAPABILITIES: capabilities}
    forwarded["params"] = params
    return forwarded


def upstream_body(message: dict[str, Any], body: bytes) -> bytes:
    """The body a 2026 request the proxy relays goes upstream with: tasks are the proxy's, so the upstream never sees
    the declaration (nor a legacy params.task opt-in), which would let it answer with a task of its own the proxy
    knows nothing of. The body as received when it has neither, byte for byte."""
    if declares_tasks(message) or "task" in params_of(message):
        check_reencodable(message, body)
        return dumps(without_tasks_declaration(message))
    return body


def check_reencodable(message: Any, body: bytes) -> None:
    """Refuse a request the proxy must encode again (to remove the tasks declaration, to bridge it to a 2025-era
    upstream, to run it as a task) when `dumps` would refuse it: nested deeper than jsonrpc.MAX_DUMPS_DEPTH. The
    same answer on the lane and on aiohttp's path, before anything starts."""
    if too_deep(message, body):
        raise JsonRpcError(
            INVALID_REQUEST, f"Invalid request: nested more than {MAX_DUMPS_DEPTH} levels deep, which the proxy "
            "cannot pass on"
        )  # fmt: skip
