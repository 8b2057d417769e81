"""A compressed response body, inflated in bounded slices as fast as its reader takes it.

A small gzip bomb must cost a bounded amount of memory: each step inflates at most _INFLATE_IN bytes in and
_INFLATE_OUT out, and only while the reader's buffer is below its high-water mark; the reader's own limit ends the
rest. Bytes past the end of the compressed stream are an error, never kept.
"""

from __future__ import annotations

import zlib

_INFLATE_IN = 16 * 1024
_INFLATE_OUT = 256 * 1024


class Inflater:
    """The compressed bytes received and not inflated yet, and the decoder they go through."""

    __slots__ = ("_decoder", "_compressed", "_tail")

    def __init__(self, decoder: zlib._Decompress) -> None:
        self._decoder = decoder
        self._compressed = bytearray()
        self._tail = b""
        """What the decoder left unconsumed at its last step (its output bound was reached)."""

    @classmethod
    def for_encoding(cls, encoding: str) -> Inflater | None:
        """The inflater for a Content-Encoding value (lowercase); None for identity. ValueError for others."""
        if encoding in ("gzip", "x-gzip"):
            return cls(zlib.decompressobj(16 + zlib.MAX_WBITS))
        if encoding == "deflate":
            return cls(zlib.decompressobj())
        if encoding != "identity":
            raise ValueError(f"unsupported content-encoding {encoding!r}")
        return None

    def feed(self, compressed: bytes) -> None:
        self._compressed += compressed

    @property
    def waiting_bytes(self) -> int:
        """Compressed bytes held, for the connection's flow control."""
        return len(self._compressed)

    def pending(self) -> bool:
        return bool(self._tail or self._compressed)

    def inflate_into(self, ready: bytearray, high_water: int) -> None:
        """Inflate pending bytes into `ready` while it holds less than `high_water`; the rest waits for the next
        call. ValueError when the body cannot be inflated."""
        decoder = self._decoder
        taken = 0
        while len(ready) < high_water:
            if decoder.eof:
                # Bytes past the compressed stream's end would pile up in the decoder (it keeps them all, copying
                # them at every call) and never count toward a read limit: the body is broken.
                if decoder.unused_data or self._tail or taken < len(self._compressed):
                    raise ValueError("bytes after the end of the compressed body")
                break
            if self._tail:
                data, self._tail = self._tail, b""
            elif taken < len(self._compressed):
                data = bytes(self._compressed[taken : taken + _INFLATE_IN])
                taken += len(data)
            else:
                break
            try:
                ready += decoder.decompress(data, _INFLATE_OUT)
            except zlib.error as exc:
                raise ValueError(f"undecodable compressed body ({exc})") from exc
            self._tail = decoder.unconsumed_tail
        del self._compressed[:taken]

    def finish(self) -> bytes:
        """What the decoder still holds, once the body has ended; ValueError when the compressed stream has not."""
        if not self._decoder.eof:
            raise ValueError("the upstream's compressed body ends before its compressed stream does")
        return self._decoder.flush()
