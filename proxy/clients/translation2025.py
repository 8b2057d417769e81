"""What a 2025-era client's request becomes for a server that speaks 2026-07-28 only, and what its answer becomes
for the client (clients/translated2025.py holds the sessions; this is the envelope and the results)."""

from __future__ import annotations

import copy
from typing import Any

from multidict import CIMultiDict, MultiMapping

from .. import PROTOCOL_VERSION
from .envelope import (
    META_CLIENT_CAPABILITIES,
    META_PROTOCOL_VERSION,
    NAME_PARAMS,
    encode_header_value,
    params_of,
    without_meta_key,
)
from .sessions2025 import FrontSession

META_CLIENT_INFO = "io.modelcontextprotocol/clientInfo"
META_SERVER_INFO = "io.modelcontextprotocol/serverInfo"
META_SUBSCRIPTION_ID = "io.modelcontextprotocol/subscriptionId"
_CLIENT_CAPABILITIES = ("experimental", "roots", "sampling", "elicitation")
"""What a 2025 client declares that 2026-07-28 still has (not `tasks`: a task is the proxy's, SEP-2663)."""
_SERVER_CAPABILITIES = ("experimental", "completions", "prompts", "resources", "tools")
"""What the session is offered of what the server declares: not `logging` (the proxy relays no log lines of a
call's), not `extensions` (2025 has none)."""
_2026_ONLY_FIELDS = ("resultType", "ttlMs", "cacheScope")


def capabilities_2026(declared: dict[str, Any]) -> dict[str, Any]:
    return {key: declared[key] for key in _CLIENT_CAPABILITIES if isinstance(declared.get(key), dict)}


def as_2026(message: dict[str, Any], front: FrontSession) -> dict[str, Any]:
    """The 2025 request with the 2026-07-28 envelope in its `_meta`, from what the session declared; its own `_meta`
    (a progressToken, trace context) kept."""
    params = dict(params_of(message))
    meta = dict(params["_meta"]) if isinstance(params.get("_meta"), dict) else {}
    meta[META_PROTOCOL_VERSION] = PROTOCOL_VERSION
    meta[META_CLIENT_CAPABILITIES] = capabilities_2026(front.capabilities)
    if front.client_info:
        meta[META_CLIENT_INFO] = front.client_info
    params["_meta"] = meta
    return {"jsonrpc": "2.0", "id": message["id"], "method": message["method"], "params": params}


def headers_2026(message: dict[str, Any], client_headers: MultiMapping[str]) -> CIMultiDict[str]:
    """The client's headers for the server, the 2025 ones (session id, version) replaced by SEP-2243's."""
    headers = CIMultiDict(
        (name, value)
        for name, value in client_headers.items()
        if not (lower := name.lower()).startswith("mcp-") and lower != "last-event-id"
    )
    method = message["method"]
    headers["MCP-Protocol-Version"] = PROTOCOL_VERSION
    headers["Mcp-Method"] = method
    field = NAME_PARAMS.get(method)
    value = params_of(message).get(field) if field else None
    if isinstance(value, str):
        headers["Mcp-Name"] = encode_header_value(value)
    return headers


def result_2025(result: dict[str, Any]) -> dict[str, Any]:
    """A 2026-07-28 result as a 2025 client reads it: no resultType, ttlMs, cacheScope or serverInfo `_meta`."""
    out = {key: value for key, value in result.items() if key not in _2026_ONLY_FIELDS}
    return without_meta_key(out, META_SERVER_INFO)


def initialize_result(discover: dict[str, Any], version: str) -> dict[str, Any]:
    """An InitializeResult from a DiscoverResult: its capabilities (_SERVER_CAPABILITIES), instructions and
    serverInfo."""
    capabilities = discover.get("capabilities")
    capabilities = capabilities if isinstance(capabilities, dict) else {}
    server: dict[str, Any] = {key: copy.deepcopy(capabilities[key]) for key in _SERVER_CAPABILITIES
                              if isinstance(capabilities.get(key), dict)}  # fmt: skip
    meta = discover.get("_meta")
    info = meta.get(META_SERVER_INFO) if isinstance(meta, dict) else None
    if not (isinstance(info, dict) and isinstance(info.get("name"), str) and isinstance(info.get("version"), str)):
        info = {"name": "unknown", "version": "0"}
    result: dict[str, Any] = {"protocolVersion": version, "capabilities": server, "serverInfo": info}
    if isinstance(discover.get("instructions"), str):
        result["instructions"] = discover["instructions"]
    return result
