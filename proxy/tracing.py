"""OpenTelemetry traces: a span per request, one per task from creation to its terminal status (the requests about it
linked to it), the upstream call as its child, W3C trace context continued from the client and passed upstream.

On when the `otel` extra is installed and the standard variables name an exporter (OTEL_TRACES_EXPORTER, or an
OTEL_EXPORTER_OTLP_*ENDPOINT); off otherwise, and then every function here returns after one attribute check.
Attributes follow the OpenTelemetry MCP semantic conventions (mcp.method.name, gen_ai.tool.name, jsonrpc.request.id,
mcp.protocol.version); mcp.task.id and mcp.task.status are the proxy's. Never arguments, results or credentials."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import structlog

log = structlog.get_logger(__name__)

_EXPORTER_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
_TRACE_KEYS = ("traceparent", "tracestate")


class _Off:
    enabled = False


class Tracer:
    """The proxy's tracer over an OpenTelemetry TracerProvider (the SDK's, or a test's)."""

    enabled = True

    def __init__(self, provider: Any, *, roots_recorded: bool = True) -> None:
        from opentelemetry import context, propagate, trace

        self._provider = provider
        # False when the sampler records no trace the proxy would begin (parentbased_always_off): then a request
        # whose client context is not sampled gets no span at all, and its trace fields pass upstream as sent.
        self._roots_recorded = roots_recorded
        self._tracer = provider.get_tracer("mcp-tasks-proxy")
        self._trace, self._context, self._propagate = trace, context, propagate
        self._server, self._client = trace.SpanKind.SERVER, trace.SpanKind.CLIENT

    def begin_request(
        self, headers: Mapping[str, str], message: dict[str, Any], method: str, tool: str | None
    ) -> tuple[Any, object] | None:
        """The request's span, made current: continued from the client's `traceparent` header, else from its
        `params._meta` (as MCP's semantic conventions carry it), else a new trace. None when the sampler could
        record nothing of the request: its span would be one the SDK makes and drops, at about a fifth of the
        request's CPU (docs/benchmarks.md)."""
        carrier: Mapping[str, Any] = headers
        if "traceparent" not in headers:
            params = message.get("params")
            meta = params.get("_meta") if isinstance(params, dict) else None
            # A client's _meta may be anything: only an object's string trace keys are read.
            carrier = (
                {k: v for k, v in meta.items() if k in _TRACE_KEYS and isinstance(v, str)}
                if isinstance(meta, dict)
                else {}
            )
        if not self._roots_recorded and "traceparent" not in carrier:
            return None
        parent = self._propagate.extract(carrier)
        if not self._roots_recorded and not self._trace.get_current_span(parent).get_span_context().trace_flags.sampled:
            return None
        attributes: dict[str, Any] = {"mcp.method.name": method, "network.protocol.name": "http"}
        request_id = message.get("id")
        if isinstance(request_id, (str, int)) and not isinstance(request_id, bool):
            attributes["jsonrpc.request.id"] = str(request_id)
        version = headers.get("MCP-Protocol-Version")
        if version:
            attributes["mcp.protocol.version"] = version
        if tool is not None:
            attributes["gen_ai.tool.name"] = tool
            attributes["gen_ai.operation.name"] = "execute_tool"
        name = f"{method} {tool}" if tool else method
        span = self._tracer.start_span(name, context=parent, kind=self._server, attributes=attributes)
        token = self._context.attach(self._trace.set_span_in_context(span))
        return span, token

    def end_request(
        self, handle: tuple[Any, object], *, status: int, task_id: str | None, task_trace: str | None, mode: str
    ) -> None:
        span, token = handle
        if not span.is_recording():  # not sampled: what would be set is dropped anyway
            span.end()
            _detach(token)
            return
        if task_id is not None:
            span.set_attribute("mcp.task.id", task_id)
        span.set_attribute("http.response.status_code", status)
        span.set_attribute("mcp_tasks_proxy.mode", mode)
        if task_trace is not None:
            linked = self._trace.get_current_span(self._propagate.extract({"traceparent": task_trace}))
            span.add_link(linked.get_span_context(), {"mcp.task.id": task_id or ""})
        if status >= 500:
            span.set_status(self._trace.StatusCode.ERROR)
            span.set_attribute("error.type", str(status))
        span.end()
        _detach(token)

    def _unrecorded(self, parent: Any = None) -> bool:
        """Nothing begun under `parent` (the current span when None) could be recorded: the sampler begins no trace
        of its own and the parent is not sampled."""
        if self._roots_recorded:
            return False
        span = parent if parent is not None else self._trace.get_current_span()
        return not span.get_span_context().trace_flags.sampled

    def start_task(self, task_id: str, tool: str) -> Any:
        """The task's span, a child of the current one (the request that created it); ended by end_task. None when
        it could not be recorded: then its calls carry the client's trace fields as sent, as a relayed call does."""
        if self._unrecorded():
            return None
        attributes = {"mcp.task.id": task_id, "gen_ai.tool.name": tool, "mcp.method.name": "tools/call"}
        return self._tracer.start_span(f"task {tool}", attributes=attributes)

    def traceparent(self, span: Any) -> str | None:
        """The span's W3C traceparent, kept with the task so that any replica links to it."""
        if span is None:
            return None
        carrier: dict[str, str] = {}
        self._propagate.inject(carrier, context=self._trace.set_span_in_context(span))
        return carrier.get("traceparent")

    def end_task(self, span: Any, status: str, *, error_code: Any = None) -> None:
        if span is None:
            return
        span.set_attribute("mcp.task.status", status)
        if status == "failed":
            span.set_status(self._trace.StatusCode.ERROR)
            if error_code is not None:
                span.set_attribute("rpc.response.status_code", str(error_code))
        span.end()

    @contextlib.contextmanager
    def upstream_call(self, task_span: Any, tool: str, *, attempt: int = 1, run: int = 1) -> Iterator[Any]:
        """One attempt of the task's call upstream, current while it runs: its headers carry this span's context.
        `attempt` counts the attempts of one round (retries of transient failures), `run` the runs of the call
        (another after a lost replica)."""
        # Before its task exists (inside a sync window) the attempt belongs to the request that makes it.
        if self._unrecorded(task_span):
            yield None
            return
        parent = self._trace.set_span_in_context(task_span) if task_span is not None else None
        attributes = {"mcp.method.name": "tools/call", "gen_ai.tool.name": tool}
        attributes["gen_ai.operation.name"] = "execute_tool"
        attributes["mcp.task.attempt"] = attempt
        attributes["mcp.task.run"] = run
        with self._tracer.start_as_current_span(
            f"tools/call {tool}", context=parent, kind=self._client, attributes=attributes
        ) as span:
            yield span

    def failed_attempt(self, span: Any, reason: str) -> None:
        """An attempt that failed transiently (`reason`: unsent, unanswered), whether or not another follows. No
        message: an upstream's wording may carry anything."""
        if span is None:
            return
        span.set_attribute("error.type", reason)
        span.set_status(self._trace.StatusCode.ERROR)

    def inject(self, headers: MutableMapping[str, str]) -> None:
        """The current span's context on an upstream request, in place of the client's; with no span current (a
        request the sampler records nothing of), the client's stay as they are."""
        fields = self.trace_fields()
        if fields is None:
            return
        for key in _TRACE_KEYS:
            headers.pop(key, None)
        headers.update(fields)

    def trace_fields(self) -> dict[str, str] | None:
        """The propagator's fields for the current span (traceparent, and tracestate when there is one); None when
        no span is current."""
        span = self._trace.get_current_span()
        if not span.get_span_context().is_valid:
            return None
        fields: dict[str, str] = {}
        self._propagate.inject(fields)
        return fields

    def shutdown(self) -> None:
        shutdown = getattr(self._provider, "shutdown", None)
        if shutdown is not None:
            shutdown()


def _detach(token: Any) -> None:
    """Restore the context a request's span was attached over, when this is that context: a request answered from
    another task (a bridged call taken over) ends its span there, with nothing to restore (OpenTelemetry's own
    detach would log the ValueError as an error, with its traceback)."""
    with contextlib.suppress(ValueError):
        token.var.reset(token)


TRACER: Tracer | _Off = _Off()


def install(tracer: Tracer | _Off) -> None:
    global TRACER
    TRACER = tracer


def configure(environ: Mapping[str, str] = os.environ) -> str:
    """Turn tracing on from the standard OTEL_* variables when the SDK is installed; what was done, for the log."""
    exporter = environ.get("OTEL_TRACES_EXPORTER", "otlp" if any(environ.get(v) for v in _EXPORTER_VARIABLES) else "")
    if environ.get("OTEL_SDK_DISABLED", "").lower() == "true" or exporter in ("", "none"):
        install(_Off())
        return "off (no OTEL_TRACES_EXPORTER or OTEL_EXPORTER_OTLP_ENDPOINT)"
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError:
        install(_Off())
        return "off (the otel extra is not installed: pip install 'mcp-tasks-proxy[otel]')"
    if environ.get("OTEL_TRACES_SAMPLER", "").lower() == "always_off":  # read as the SDK reads it
        # No span could ever be recorded, whatever the client's context says: making them would cost each request
        # about a fifth of its CPU for nothing (docs/benchmarks.md). The client's trace context passes through as is.
        install(_Off())
        return "off (OTEL_TRACES_SAMPLER=always_off: no span is ever recorded)"
    if exporter == "console":
        span_exporter: Any = ConsoleSpanExporter()
    elif exporter == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            install(_Off())
            return "off (the OTLP/HTTP exporter is not installed: pip install 'mcp-tasks-proxy[otel]')"
        span_exporter = OTLPSpanExporter()  # OTEL_EXPORTER_OTLP_* say where, with which headers
    else:
        install(_Off())
        return f"off (OTEL_TRACES_EXPORTER={exporter} is not one of otlp, console, none)"
    # Resource.create reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES.
    resource = Resource.create({"service.name": environ.get("OTEL_SERVICE_NAME", "mcp-tasks-proxy")})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(span_exporter))
    # The SDK reads the same variable (TracerProvider's sampler); with this one it begins no trace of its own.
    roots_recorded = environ.get("OTEL_TRACES_SAMPLER", "").lower() != "parentbased_always_off"
    install(Tracer(provider, roots_recorded=roots_recorded))
    if not roots_recorded:
        return f"on ({exporter}; parentbased_always_off: spans only for requests whose client context is sampled)"
    return f"on ({exporter})"
