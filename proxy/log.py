"""structlog set-up: JSON lines for machines, console lines on a terminal.

An unexpected error is logged as its type and its frames (file, line, function) only: structlog's default would add
each frame's local variables and the exception's message, and either can hold a tool's arguments, a result, an
input response or a credential.
"""

from __future__ import annotations

import datetime
import itertools
import json
import logging
import secrets
import sys
from contextvars import ContextVar
from typing import Any

import orjson
import structlog
from structlog.tracebacks import ExceptionDictTransformer

_frames_only = ExceptionDictTransformer(show_locals=False)

# Request ids: unique per process and cheap (no random bytes per request); the prefix tells processes apart.
_REQUEST_ID_PREFIX = f"{secrets.token_hex(4)}-"
_request_numbers = itertools.count(1)
_request_id: ContextVar[str | int | None] = ContextVar("request_id", default=None)


def bind_request_id(client_id: str | None) -> None:
    """Name the current request in every log line written while it runs (and by what it starts): the client's own
    X-Request-Id, else a number of this process's. One context variable set per request, the id formatted only
    when a line is written: most requests write none."""
    _request_id.set(client_id if client_id is not None else next(_request_numbers))


def _add_request_id(logger: Any, method: str, event: dict[str, Any]) -> dict[str, Any]:
    request_id = _request_id.get()
    if request_id is not None:
        event.setdefault(
            "request_id", request_id if isinstance(request_id, str) else f"{_REQUEST_ID_PREFIX}{request_id:x}"
        )
    return event


MAX_LOGGED_CHARS = 512
"""The longest text a log line carries in one field: a tool name or method is the client's to choose (up to the
body's limit, megabytes), and a line is written for every request."""


def _bounded_values(logger: Any, method: str, event: dict[str, Any]) -> dict[str, Any]:
    for key, value in event.items():
        if type(value) is str and len(value) > MAX_LOGGED_CHARS:
            event[key] = f"{value[:MAX_LOGGED_CHARS]}... ({len(value)} characters)"
    return event


def _trace(exc_info: Any) -> list[dict[str, Any]]:
    """Each exception of the chain as {exc_type, frames}: no message, no locals."""
    trace = []
    for stack in _frames_only(exc_info):
        frames = [{"filename": f["filename"], "lineno": f["lineno"], "name": f["name"]} for f in stack["frames"]]
        trace.append({"exc_type": stack["exc_type"], "is_cause": stack["is_cause"], "frames": frames})
    return trace


def _exception_fields(logger: Any, method: str, event: dict[str, Any]) -> dict[str, Any]:
    exc_info = event.pop("exc_info", None)
    if exc_info:
        if exc_info is True:
            exc_info = sys.exc_info()
        elif isinstance(exc_info, BaseException):
            exc_info = (type(exc_info), exc_info, exc_info.__traceback__)
        if exc_info[0] is not None:
            event["exception"] = _trace(exc_info)
    return event


def _timestamp(logger: Any, method: str, event: dict[str, Any]) -> dict[str, Any]:
    """The time as a datetime, which orjson writes in RFC 3339 as structlog's TimeStamper(fmt="iso", utc=True)
    does: 0.2 µs, where the TimeStamper's string takes 1.6."""
    event["timestamp"] = datetime.datetime.now(datetime.UTC)
    return event


def _not_json(value: Any) -> str:
    return value.isoformat().replace("+00:00", "Z") if isinstance(value, datetime.datetime) else repr(value)


_ORJSON_OPTIONS = orjson.OPT_UTC_Z | orjson.OPT_PASSTHROUGH_DATACLASS  # a dataclass as its repr: no repr=False field
_LINE_BREAKS = ((b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"), (b"\xc2\x85", b"\\u0085"))
"""What some readers (Python's splitlines among them) take for the end of a line, escaped as json.dumps did."""


def _json_line(event: dict[str, Any], **_: Any) -> bytes:
    """One JSON line in UTF-8: orjson (a tenth of json.dumps' time, and a request writes a line); the standard
    library for what orjson refuses (integers past 64 bits, lone surrogates, keys that are not strings)."""
    try:
        line = orjson.dumps(event, default=_not_json, option=_ORJSON_OPTIONS)
    except TypeError:
        return _json_text(event).encode()
    if not line.isascii():  # a field the client chose (a tool's name) may hold one
        for raw, escaped in _LINE_BREAKS:
            line = line.replace(raw, escaped)
    return line


def _json_text(event: dict[str, Any], **_: Any) -> str:
    """One JSON line in ASCII, whatever stderr's encoding: for the standard library's handler (aiohttp's own
    loggers), which writes through stderr's text layer, and for what orjson refuses."""
    return json.dumps(event, default=_not_json, separators=(",", ":"))


def _console_trace(sio: Any, exc_info: Any) -> None:
    """ConsoleRenderer's exception formatter: the same frames, as text."""
    for stack in _trace(exc_info):
        sio.write("\nTraceback (frames only; messages and locals are not logged):\n")
        for frame in stack["frames"]:
            sio.write(f'  File "{frame["filename"]}", line {frame["lineno"]}, in {frame["name"]}\n')
        sio.write(f"{stack['exc_type']}\n")


def configure_logging(*, level: str = "info", format: str = "auto") -> None:
    """Route structlog and the stdlib (aiohttp's own loggers) through one renderer on stderr."""
    use_console = format == "console" or (format == "auto" and sys.stderr.isatty())
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        _add_request_id,
        _bounded_values,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True) if use_console else _timestamp,
    ]
    stderr_bytes = getattr(sys.stderr, "buffer", None)
    renderer: structlog.typing.Processor
    if use_console:
        renderer = text_renderer = structlog.dev.ConsoleRenderer(exception_formatter=_console_trace)
    else:
        renderer = structlog.processors.JSONRenderer(serializer=_json_line if stderr_bytes else _json_text)
        text_renderer = structlog.processors.JSONRenderer(serializer=_json_text)
    tail: list[structlog.typing.Processor] = [] if use_console else [_exception_fields]
    structlog.configure(
        processors=[*shared, *tail, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        # Bytes written as rendered: a request's line is not encoded again by a text layer.
        logger_factory=(
            structlog.BytesLoggerFactory(file=stderr_bytes)
            if stderr_bytes and not use_console
            else structlog.PrintLoggerFactory(file=sys.stderr)
        ),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *tail, text_renderer],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # aiohttp.access would repeat the proxy's own request_handled line.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
