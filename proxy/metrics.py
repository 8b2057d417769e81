"""Prometheus metrics, one registry per application (so tests can build several apps in one process)."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

# Method labels come from clients; only known MCP methods are kept, so a client cannot grow the label set.
KNOWN_METHODS = frozenset(
    {
        "initialize",
        "ping",
        "server/discover",
        "tools/list",
        "tools/call",
        "prompts/list",
        "prompts/get",
        "resources/list",
        "resources/templates/list",
        "resources/read",
        "completion/complete",
        "subscriptions/listen",
        "logging/setLevel",
        "tasks/get",
        "tasks/update",
        "tasks/cancel",
        "tasks/result",
        "tasks/list",
    }
)
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_OPERATION_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)
"""The OpenTelemetry MCP semantic conventions' advice for mcp.server/client.operation.duration."""
_PROTOCOL_VERSIONS = frozenset({"", "2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25", "2026-07-28"})
_OPERATION_LABELS = ["mcp_method_name", "gen_ai_tool_name", "error_type", "mcp_protocol_version", "network_transport"]
_DURATION_BUCKETS = (0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200)


MAX_LABEL_VALUES = 256
OTHER_VALUE = "_other"
MAX_LABEL_CHARS = 128


class _Bounded:
    """A labelled metric whose first label comes from outside: a tool name a client chose (any name a glob rule
    matches), an error code an upstream sent. Its first MAX_LABEL_VALUES values are labels of their own; later
    ones count as OTHER_VALUE, so that no client or upstream grows the metrics without bound. Children are kept
    in a dict as well: prometheus_client's labels() validates and takes a lock on every call (about 2.5 µs, and
    a task counts four times)."""

    __slots__ = ("_metric", "_children", "_firsts")

    def __init__(self, metric: Counter | Histogram) -> None:
        self._metric = metric
        self._children: dict[tuple[str, ...], Any] = {}
        self._firsts: set[str] = set()

    def labels(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is not None:
            return child
        if values[0] not in self._firsts:
            # A value longer than a name is: one would be repeated on every line of every scrape (a tool name of
            # 4 MB made each scrape 150 MB); it counts as the other values past the bound do.
            if len(self._firsts) < MAX_LABEL_VALUES and len(values[0]) <= MAX_LABEL_CHARS:
                self._firsts.add(values[0])
            else:
                values = (OTHER_VALUE, *values[1:])
                child = self._children.get(values)
                if child is not None:
                    return child
        child = self._children[values] = self._metric.labels(*values)
        return child


def method_label(method: str | None) -> str:
    if method is None:
        return "none"
    return method if method in KNOWN_METHODS else "other"


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._requests = _RequestStats()
        r.register(self._requests)
        self.errors = _Bounded(Counter(
            "mcp_tasks_proxy_errors", "JSON-RPC errors the proxy answered or recorded in a failed task, by code",
            ["code"], registry=r,
        ))  # fmt: skip
        self.tasks_created = _Bounded(
            Counter("mcp_tasks_proxy_tasks_created", "Tasks created, by tool", ["tool"], registry=r)
        )
        self.tasks_finished = _Bounded(Counter(
            "mcp_tasks_proxy_tasks_finished", "Tasks that reached a terminal status here, by tool and status",
            ["tool", "status"], registry=r,
        ))  # fmt: skip
        self.task_seconds = _Bounded(Histogram(
            "mcp_tasks_proxy_task_duration_seconds", "From creation to the terminal status, by tool and status",
            ["tool", "status"], buckets=_DURATION_BUCKETS, registry=r,
        ))  # fmt: skip
        self.upstream_seconds = _Bounded(Histogram(
            "mcp_tasks_proxy_upstream_call_seconds", "Each upstream attempt of a background call, by outcome",
            ["tool", "outcome"], buckets=_DURATION_BUCKETS, registry=r,
        ))  # fmt: skip
        self.input_rounds = _Bounded(
            Counter(
                "mcp_tasks_proxy_input_rounds", "Times a task asked its client for input, by tool", ["tool"], registry=r
            )
        )
        self.upstream_errors = Counter(
            "mcp_tasks_proxy_upstream_errors", "Upstream failures: unreachable, timed out, broken or not JSON-RPC; "
            "`where` is request (answered to a client) or task (a background call's attempt)",
            ["where"], registry=r,
        )  # fmt: skip
        self.upstream_retries = Counter(
            "mcp_tasks_proxy_upstream_retries", "Background calls sent again after a transient failure, by reason: "
            "unsent (the request never left) or unanswered (no answer came back; idempotent rules only)",
            ["reason"], registry=r,
        )  # fmt: skip
        self.tasks_taken_over = Counter(
            "mcp_tasks_proxy_tasks_taken_over", "Tasks of a lost or stopping replica, by what became of them: "
            "run_again (here, after the owner was lost), unknown (failed: the call may not run twice), released "
            "(handed to the other replicas at shutdown)",
            ["outcome"], registry=r,
        )  # fmt: skip
        for outcome in ("run_again", "unknown", "released"):  # each a series from the start, for rate() and alerts
            self.tasks_taken_over.labels(outcome)
        self.rate_limited = Counter(
            "mcp_tasks_proxy_rate_limited", "Requests refused past a rate limit (limits.rates), by limit",
            ["limit"], registry=r,
        )  # fmt: skip
        self.rate_limit_local = Counter(
            "mcp_tasks_proxy_rate_limit_local", "Rate-limit checks a replica made alone because Redis did not "
            "answer (the limit then holds per replica), by limit", ["limit"], registry=r,
        )  # fmt: skip
        self.client_operations = _Bounded(Histogram(
            "mcp_client_operation_duration_seconds", "The OpenTelemetry MCP semantic conventions' "
            "mcp.client.operation.duration: each tools/call the proxy makes upstream for a task, by tool and error "
            "type (empty when it succeeded)", ["gen_ai_tool_name", "error_type"], buckets=_OPERATION_BUCKETS,
            registry=r,
        ))  # fmt: skip
        self.connections_refused = Counter(
            "mcp_tasks_proxy_connections_refused", "Client connections refused past listen.max_connections",
            registry=r,
        )  # fmt: skip

    def observe_request(
        self, method: str, mode: str, status: int, seconds: float, operation: tuple[str, str, str] | None = None
    ) -> None:
        """Count one answered request (this runs for every request); `operation`, for a JSON-RPC request: its tool,
        error type and protocol version, for mcp_server_operation_duration_seconds."""
        self._requests.observe(method, mode, status, seconds, operation)

    def observe_upstream_operation(self, tool: str, error_type: str, seconds: float) -> None:
        """One tools/call the proxy made upstream for a task (mcp_client_operation_duration_seconds)."""
        self.client_operations.labels(tool, error_type).observe(seconds)

    def watch_running(self, running_by_status: Callable[[], dict[str, int]]) -> None:
        """Report the tasks whose calls run on this replica, by status, at every scrape."""
        defaults = {"working": 0, "input_required": 0}
        self.watch("mcp_tasks_proxy_tasks_running", "Tasks whose upstream call runs on this replica, by status",
                   "status", lambda: {**defaults, **running_by_status()})  # fmt: skip

    def watch_unreadable(self, unreadable_by_reason: Callable[[], dict[str, int]]) -> None:
        """Report the lines a stdio server wrote that could not be read, by reason, at every scrape."""
        self.watch("mcp_tasks_proxy_upstream_unreadable", "Lines a stdio server wrote that could not be read, by "
                   "reason (too_long, invalid_utf8, not_json, non_finite_number, not_jsonrpc); each failed the call "
                   "it answered when its id could be told", "reason", unreadable_by_reason, counter=True)  # fmt: skip

    def watch(self, name: str, documentation: str, label: str, read: Callable[[], dict[str, int]], *,
              counter: bool = False) -> None:  # fmt: skip
        """A gauge (or counter) with one label, read from `read` at every scrape."""
        self.registry.register(_ReadAtScrape(name, documentation, label, read, counter))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ReadAtScrape(Collector):
    def __init__(
        self, name: str, documentation: str, label: str, read: Callable[[], dict[str, int]], counter: bool
    ) -> None:
        self._name, self._documentation, self._label = name, documentation, label
        self._read, self._counter = read, counter

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        kind = CounterMetricFamily if self._counter else GaugeMetricFamily
        family = kind(self._name, self._documentation, labels=[self._label])
        for value, count in sorted(self._read().items()):
            family.add_metric([value], count)
        yield family


class _RequestStats(Collector):
    """The requests counter and the request latency histogram, kept as plain numbers and exposed at each scrape.
    Counting a request is a dict lookup and a bisect, with no lock (the event loop is one thread), where
    prometheus_client's labelled children cost about 2.5 µs a request on the pass-through path."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str, int], int] = {}
        self._latency: dict[tuple[str, str], list[float]] = {}
        """Per (method, mode): the count in each bucket (not cumulative), the count past the last bound, the sum."""
        self._operations: dict[tuple[str, str, str, str], list[float]] = {}
        """Per (method, tool, error type, protocol version): as `_latency`, on the semantic conventions' bounds."""
        self._tools: set[str] = set()

    def observe(
        self, method: str, mode: str, status: int, seconds: float, operation: tuple[str, str, str] | None = None
    ) -> None:
        key = (method, mode, status)
        self._counts[key] = self._counts.get(key, 0) + 1
        latency = self._latency.get((method, mode))
        if latency is None:
            latency = self._latency[(method, mode)] = [0] * (len(_LATENCY_BUCKETS) + 2)
        latency[bisect.bisect_left(_LATENCY_BUCKETS, seconds)] += 1  # le: the first bound at or above
        latency[-1] += seconds
        if operation is None:
            return
        tool, error_type, version = operation
        if tool and tool not in self._tools:  # a client's name: a bounded set of them, as _Bounded keeps
            if len(self._tools) < MAX_LABEL_VALUES and len(tool) <= MAX_LABEL_CHARS:
                self._tools.add(tool)
            else:
                tool = OTHER_VALUE
        labels = (method, tool, error_type, version if version in _PROTOCOL_VERSIONS else OTHER_VALUE)
        counts = self._operations.get(labels)
        if counts is None:
            counts = self._operations[labels] = [0] * (len(_OPERATION_BUCKETS) + 2)
        counts[bisect.bisect_left(_OPERATION_BUCKETS, seconds)] += 1
        counts[-1] += seconds

    def collect(self) -> Iterable[CounterMetricFamily | HistogramMetricFamily]:
        requests = CounterMetricFamily(
            "mcp_tasks_proxy_requests", "HTTP requests handled, by JSON-RPC method, mode and HTTP status",
            labels=["method", "mode", "status"],
        )  # fmt: skip
        for (method, mode, status), count in sorted(self._counts.items()):
            requests.add_metric([method, mode, str(status)], count)
        yield requests
        latency = HistogramMetricFamily(
            "mcp_tasks_proxy_request_seconds", "Time to answer a request (to its last byte for streams)",
            labels=["method", "mode"],
        )  # fmt: skip
        for labels, counts in sorted(self._latency.items()):
            latency.add_metric(list(labels), _buckets(counts, _LATENCY_BUCKETS), sum_value=counts[-1])
        yield latency
        operations = HistogramMetricFamily(
            "mcp_server_operation_duration_seconds", "The OpenTelemetry MCP semantic conventions' "
            "mcp.server.operation.duration: each JSON-RPC request a client made, by method, tool, error type (401, "
            "403 or 429; else the JSON-RPC error code the proxy answered, else an HTTP status from 400; empty for a "
            "success), protocol version and transport", labels=_OPERATION_LABELS,
        )  # fmt: skip
        for (method, tool, error_type, version), counts in sorted(self._operations.items()):
            operations.add_metric([method, tool, error_type, version, "tcp"], _buckets(counts, _OPERATION_BUCKETS),
                                  sum_value=counts[-1])  # fmt: skip
        yield operations


def _buckets(counts: list[float], bounds: tuple[float, ...]) -> list[tuple[str, float]]:
    cumulative = list(itertools.accumulate(counts[:-1]))  # one count per bound, then the +Inf one
    return list(zip([floatToGoString(bound) for bound in bounds] + ["+Inf"], cumulative, strict=True))
