"""structlog set-up: JSON lines for machines, console lines on a terminal."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(*, level: str = "info", format: str = "auto") -> None:
    """Route structlog and the stdlib (aiohttp's own loggers) through one renderer on stderr."""
    use_console = format == "console" or (format == "auto" and sys.stderr.isatty())
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: structlog.typing.Processor = (
        structlog.dev.ConsoleRenderer() if use_console else structlog.processors.JSONRenderer()
    )
    tail: list[structlog.typing.Processor] = [] if use_console else [structlog.processors.dict_tracebacks]
    structlog.configure(
        processors=[*shared, *tail, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *tail, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # aiohttp.access would repeat the proxy's own request_handled line.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
