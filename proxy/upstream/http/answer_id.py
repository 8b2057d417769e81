"""Whose answer a relayed JSON body is. A pass-through answer to another request (a late duplicate on a pooled
connection, a confused server) is refused as an upstream failure, as a task's call is: relayed, it would answer one
client with someone else's result. So is a batch (an array) in answer to a single request.

A small body is checked whole (inflated first when the upstream compressed it, within a bound); a large one, or one
of unknown length, as it streams, by ijson's incremental parser (yajl's C code), in bounded memory: the relay holds
its last piece back until the check ends (answer.py)."""

from __future__ import annotations

import contextlib
import zlib
from typing import Any

import ijson

from ...jsonrpc import RequestId, UpstreamError, dumps, loads

MAX_INFLATED_BYTES = 16 * 1024 * 1024
"""What of a compressed answer is inflated for its check at most; past it, what was inflated is checked."""

_OTHER_ID = "the upstream answered a different request id"
_BATCH = "the upstream answered a single request with a batch"


def check_answer_id(payload: bytes, request_id: RequestId, upstream_url: str, encoding: str = "") -> None:
    """UpstreamError when the whole JSON `payload` answers another request. An answer that opens with this
    request's id, as the SDKs write it, is known to be its own without parsing."""
    if encoding and encoding != "identity":
        payload = _inflated(payload, encoding)
    encoded = dumps(request_id)
    if payload.startswith(b'{"jsonrpc":"2.0","id":%s,' % encoded) or payload.startswith(
        b'{"jsonrpc": "2.0", "id": %s, ' % encoded  # Python's json.dumps as it is called by default
    ):
        return
    try:
        message = loads(payload)
    except ValueError:
        return  # not JSON: the client sees what the upstream sent, as for any answer that is not JSON-RPC
    reason = _refused(message, request_id)
    if reason is not None:
        raise UpstreamError(reason, upstream=upstream_url)


def _refused(message: Any, request_id: RequestId) -> str | None:
    if isinstance(message, list):
        return _BATCH
    if isinstance(message, dict) and message.get("id", request_id) not in (request_id, None):
        return _OTHER_ID
    return None


_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
"""zlib's window bits for each Content-Encoding it reads; others (br, zstd) are not checked."""


def _inflated(payload: bytes, encoding: str) -> bytes:
    wbits = _WBITS.get(encoding)
    if wbits is None:
        return payload
    try:
        return zlib.decompressobj(wbits).decompress(payload, MAX_INFLATED_BYTES)
    except zlib.error:
        return payload


class StreamedIdCheck:
    """Follows a JSON answer as it streams for its top-level id, and whether it is an array."""

    __slots__ = ("_request_id", "_events", "_parser", "_decoder", "refused", "_done")

    def __init__(self, request_id: RequestId, encoding: str = "") -> None:
        self._request_id = request_id
        self._events = ijson.sendable_list()
        self._parser = ijson.parse_coro(self._events, use_float=True)
        wbits = _WBITS.get(encoding)
        self._decoder = zlib.decompressobj(wbits) if wbits is not None else None
        self._done = bool(encoding and encoding != "identity" and wbits is None)  # not read: not checked
        self.refused: str | None = None
        """Why the answer is not this request's, once that is known."""

    def feed(self, chunk: bytes) -> None:
        if self._done:
            return
        try:
            if self._decoder is not None:
                chunk = self._decoder.decompress(chunk)
            self._parser.send(chunk)
        except (ijson.JSONError, zlib.error, ValueError):
            self._done = True  # not JSON: relayed as it is, as a small body would be
            return
        for prefix, event, value in self._events:
            if prefix == "" and event == "start_array":
                self._verdict(_BATCH)
            elif prefix == "id" and event in ("number", "string", "null"):
                self._verdict(None if value is None or value == self._request_id else _OTHER_ID)
            if self._done:
                break
        del self._events[:]

    def end(self) -> str | None:
        """The verdict once the body ended: why it is refused, or None."""
        if not self._done:
            self._done = True
            with contextlib.suppress(ijson.JSONError, ijson.IncompleteJSONError, ValueError):
                self._parser.close()
        return self.refused

    def _verdict(self, refused: str | None) -> None:
        self.refused = refused
        self._done = True
