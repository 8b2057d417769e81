"""A call's context (its message, the client's headers for the upstream, what it may be asked, the client's own
upstream session for a durable call), sealed for the store
so that another replica can run it again after this one is lost (takeover.py).

The headers carry the client's credentials: they go to Redis only encrypted and authenticated (AES-256-GCM, from
pyca/cryptography), under a key derived from the principal key the operator gives every replica
(`security.principal_key` or MCP_TASKS_PROXY_PRINCIPAL_KEY). A key the replicas agreed on through Redis itself
would protect nothing from whoever reads Redis: without an operator's key, no context is stored and a lost
replica's tasks end "outcome unknown" as before. The task id is the associated data: a context moved to another
task's key does not open.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
from typing import Any

import structlog
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from multidict import CIMultiDict

from ..jsonrpc import dumps, loads
from ..upstream.events import UpstreamTask
from ..upstream.routing import LegacySession
from .job import ToolCall

log = structlog.get_logger(__name__)

_VERSION = b"\x01"
_NONCE_BYTES = 12
_LABEL = b"mcp-tasks-proxy call context v1"


class CallSeal:
    """Seals and opens call contexts with one replica-shared key."""

    __slots__ = ("_aead",)

    def __init__(self, principal_key: bytes) -> None:
        # A key of its own, not the principal key itself: the hashes keyed by that one are in the records.
        self._aead = AESGCM(hmac.new(principal_key, _LABEL, hashlib.sha256).digest())

    def seal(self, task_id: str, call: ToolCall) -> bytes:
        context = {
            "message": call.message,
            "headers": [[name, value] for name, value in call.headers.items()],
            "capabilities": call.capabilities,
            "caller": call.caller,
            "credential": call.credential,
        }
        session = call.client_session
        if session is not None:  # a durable call goes on its client's own upstream session, by id
            context["session"] = [session.session_id, session.protocol_version]
        return self._sealed(dumps(context), _bound(task_id, call.principal, call.tool))

    def seal_upstream_task(self, task_id: str, upstream: UpstreamTask, principal: str) -> str:
        """The server's own task for the call, sealed as text for the record: its session id is a handle to the
        proxy's session with the server, for the replicas' eyes only."""
        value = dumps([upstream.task_id, upstream.session_id, upstream.protocol_version])
        return base64.urlsafe_b64encode(self._sealed(value, _bound(task_id, principal, ""))).decode()

    def unseal_upstream_task(self, task_id: str, sealed: str, principal: str) -> UpstreamTask | None:
        try:
            opened = self._opened(base64.urlsafe_b64decode(sealed), _bound(task_id, principal, ""))
            upstream_task, session_id, version = loads(opened)
            if not isinstance(upstream_task, str) or not isinstance(version, str):
                raise TypeError("not text")
            if session_id is not None and not isinstance(session_id, str):
                raise TypeError("not text")
            return UpstreamTask(upstream_task, session_id, version)
        except (InvalidTag, ValueError, TypeError) as exc:
            log.warning("upstream_task_unreadable", task_id=task_id, reason=type(exc).__name__)
            return None

    def seal_credential(self, task_id: str, principal: str, authorization: str) -> bytes:
        """The owner's newest Authorization for its running task, for whichever replica runs the call."""
        return self._sealed(authorization.encode("utf-8", "surrogateescape"), _credential_bound(task_id, principal))

    def unseal_credential(self, task_id: str, sealed: bytes, principal: str) -> str | None:
        try:
            return self._opened(sealed, _credential_bound(task_id, principal)).decode("utf-8", "surrogateescape")
        except (InvalidTag, ValueError) as exc:
            log.warning("task_credential_unreadable", task_id=task_id, reason=type(exc).__name__)
            return None

    def _sealed(self, plain: bytes, bound: bytes) -> bytes:
        # 96 random bits per nonce: a repeat is as likely as a task id colliding, under one key for any number
        # of tasks within the 2^32 messages AES-GCM allows per key with random nonces (NIST SP 800-38D).
        nonce = os.urandom(_NONCE_BYTES)
        return _VERSION + nonce + self._aead.encrypt(nonce, plain, bound)

    def _opened(self, sealed: bytes, bound: bytes) -> bytes:
        if sealed[:1] != _VERSION:
            raise ValueError("unknown version")
        nonce = sealed[1 : 1 + _NONCE_BYTES]
        return self._aead.decrypt(nonce, sealed[1 + _NONCE_BYTES :], bound)

    def unseal(self, task_id: str, sealed: bytes, principal: str, tool: str) -> ToolCall | None:
        """The call sealed for this task, principal and tool, or None (logged) when it does not open: another key
        (the operator changed it), another task's context, a record whose owner or tool was changed in the store,
        altered bytes, or a shape this version does not read."""
        try:
            call = _call_of(loads(self._opened(sealed, _bound(task_id, principal, tool))), principal)
            if call.tool != tool:
                raise ValueError("another tool's call")
            return call
        except (InvalidTag, ValueError, TypeError, KeyError) as exc:
            log.warning("call_context_unreadable", task_id=task_id, reason=type(exc).__name__)
            return None


def _bound(task_id: str, principal: str, tool: str) -> bytes:
    """The associated data: what the record says a sealed value belongs to, so that editing the record's owner or
    tool in the store (to run a victim's call as someone else) makes it not open."""
    return dumps([task_id, principal, tool])


def _credential_bound(task_id: str, principal: str) -> bytes:
    """A credential's associated data: of another shape than a call's, so that neither opens as the other."""
    return dumps(["credential", task_id, principal])


def _call_of(context: Any, principal: str) -> ToolCall:
    message = context["message"]
    params = message["params"]
    if not isinstance(params, dict) or not isinstance(params.get("name"), str):
        raise ValueError("not a tools/call")
    headers: CIMultiDict[str] = CIMultiDict()
    for name, value in context["headers"]:
        if not isinstance(name, str) or not isinstance(value, str):
            raise TypeError("a header that is not text")
        headers.add(name, value)
    capabilities = context["capabilities"]
    if not isinstance(capabilities, dict):
        raise TypeError("capabilities that are not an object")
    session = None
    if "session" in context:
        session_id, version = context["session"]
        if not (session_id is None or isinstance(session_id, str)) or not isinstance(version, str):
            raise TypeError("a session that is not text")
        session = LegacySession(session_id=session_id, protocol_version=version, principal=principal, carried=True)
    return ToolCall(
        tool=params["name"],
        message=message,
        headers=headers,
        capabilities=capabilities,
        principal=principal,
        credential=str(context["credential"]),
        caller=str(context["caller"]),
        client_session=session,
    )
