"""A request the lane does not relay, answered by aiohttp on the lane's own connection, one request at a time.

Handing aiohttp the whole connection would keep every later request off the lane: an SDK client opens with
`server/discover` (the proxy's), a tasks client polls `tasks/get` (the proxy's) between its calls. So aiohttp's
request handler for a lane connection gets a `Visit` as its transport: the lane feeds it one complete request's
bytes, its writes go to the client's connection as they come (event streams included), and a response parser
(httptools) sees where aiohttp's answer ends; the lane then reads the connection again. Closing the Visit while an
answer is under way closes the client's connection; closing it between requests (aiohttp's keep-alive timer) only
ends the handler: the lane keeps its own timers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httptools
from aiohttp import web


class Visit(asyncio.Transport):
    """The transport aiohttp's handler writes to for one lane connection."""

    def __init__(
        self,
        real: asyncio.Transport,
        handlers: web.Server,
        *,
        on_answered: Callable[[bool], None],
        on_close: Callable[[], None],
    ) -> None:
        super().__init__()
        self._real = real
        self._on_answered = on_answered
        """Called (soon, outside aiohttp's write) with whether the connection stays open, once an answer ended."""
        self._on_close = on_close
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpResponseParser(self)  # answers follow each other on it, as on a connection
        self._answer: httptools.HttpResponseParser | None = None  # while one is under way
        self.handler = handlers()
        self.handler.connection_made(self)

    def request(self, data: bytes) -> None:
        """Give aiohttp one whole request."""
        self._answer = self._parser
        self.handler.data_received(data)

    @property
    def answering(self) -> bool:
        return self._answer is not None

    def on_message_complete(self) -> None:  # the response parser's: aiohttp's answer is written to its end
        answer, self._answer = self._answer, None
        keep_alive = answer is not None and answer.should_keep_alive()
        self._loop.call_soon(self._on_answered, keep_alive)

    # asyncio.Transport, as aiohttp's handler and writer use it

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._real.write(data)
        answer = self._answer
        if answer is not None:
            try:
                answer.feed_data(bytes(data))
            except httptools.HttpParserError:
                self._answer = None  # an answer the lane cannot frame: the connection ends with it
                self._parser = httptools.HttpResponseParser(self)
                self._loop.call_soon(self._on_answered, False)

    def writelines(self, chunks: Any) -> None:
        self.write(b"".join(chunks))

    def is_closing(self) -> bool:
        return self._real.is_closing()

    def close(self) -> None:
        self._on_close()

    def abort(self) -> None:
        self._on_close()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._real.get_extra_info(name, default)

    def pause_reading(self) -> None:
        pass  # aiohttp gets whole requests: there is nothing of the next one to hold back

    def resume_reading(self) -> None:
        pass

    def is_reading(self) -> bool:
        return True

    def get_write_buffer_size(self) -> int:
        return self._real.get_write_buffer_size()

    def can_write_eof(self) -> bool:
        return False
