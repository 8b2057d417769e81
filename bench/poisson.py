"""Open-loop load in Poisson arrivals timed to the microsecond: the latency a client sees at a given rate.

    python bench/poisson.py URL [--rate 1000] [--seconds 5] [--connections 16] [--tasks]

wrk's `delay()` counts whole milliseconds and its timers fire on millisecond ticks, so the "Poisson" arrivals of
`bench/run.py`'s rate runs come in bursts: with 16 connections at 1,000/s, 6.5 % of requests arrive with three or
more others in the 250 µs before them, where a Poisson process has 0.3 % (arrival times recorded by a bare server,
2026-12-05). Here each gap is drawn from the exponential distribution and each request is sent at its time, on
one of `connections` kept-alive connections. The wait is `select()`, whose timeout is in microseconds (epoll's,
and so asyncio's and uvloop's timers, are in milliseconds), with the process's timer slack set to 1 ns (50 µs by
default). httptools, the parser the proxy's lane uses, reads
the responses.

The latency runs from a request's scheduled time to its response's last byte, so the generator's own lag (the
`send lag` it reports) and a wait for a free connection count against the server, never for it. A response that
is not 200, or that carries a JSON-RPC error, voids the run.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import random
import selectors
import socket
import statistics
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httptools

_PR_SET_TIMERSLACK = 29
_STOP_AFTER_S = 30
"""A run still waiting for answers this long after its last scheduled request is void (the server is stuck)."""


@dataclass
class Result:
    requests: int
    seconds: float
    latencies_ms: list[float]
    send_lag_ms: list[float]

    def percentile(self, values: list[float], share: float) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(share * len(ordered)))]

    @property
    def p50_ms(self) -> float:
        return self.percentile(self.latencies_ms, 0.50)

    @property
    def p99_ms(self) -> float:
        return self.percentile(self.latencies_ms, 0.99)

    @property
    def lag_p99_ms(self) -> float:
        return self.percentile(self.send_lag_ms, 0.99)


@dataclass
class _Connection:
    sock: socket.socket
    parser: httptools.HttpResponseParser | None = None
    scheduled: float = 0.0
    body: list[bytes] = field(default_factory=list)
    complete: bool = False

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True


def request_bytes(url: str, body: bytes, headers: dict[str, str]) -> tuple[str, int, bytes]:
    parts = urlsplit(url)
    lines = [f"POST {parts.path or '/'} HTTP/1.1", f"Host: {parts.netloc}", f"Content-Length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return parts.hostname or "127.0.0.1", parts.port or 80, ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def run(url: str, body: bytes, headers: dict[str, str], *, rate: float, seconds: float, connections: int = 16,
        seed: int | None = None) -> Result:  # fmt: skip
    host, port, request = request_bytes(url, body, headers)
    # The kernel may fire a sleeper's timer up to its "timer slack" late, 50 µs by default: 1 ns here (Linux).
    ctypes.CDLL(None).prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)
    rng = random.Random(seed)
    schedule: list[float] = []
    moment = 0.0
    while True:
        moment += rng.expovariate(rate)
        if moment >= seconds:
            break
        schedule.append(moment)
    selector = selectors.SelectSelector()  # select(): a timeout in microseconds
    idle: collections.deque[_Connection] = collections.deque()
    for _ in range(connections):
        sock = socket.create_connection((host, port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        conn = _Connection(sock)
        conn.parser = httptools.HttpResponseParser(conn)
        selector.register(sock, selectors.EVENT_READ, conn)
        idle.append(conn)
    latencies: list[float] = []
    lags: list[float] = []
    waiting: collections.deque[float] = collections.deque()
    busy = 0
    sent = 0
    clock = time.perf_counter
    start = clock() + 0.05
    try:
        while sent < len(schedule) or busy:
            now = clock() - start
            if now > seconds + _STOP_AFTER_S:
                raise SystemExit(f"{url}: {busy} requests unanswered {_STOP_AFTER_S} s after the last was due")
            while sent + len(waiting) < len(schedule) and schedule[sent + len(waiting)] <= now:
                waiting.append(schedule[sent + len(waiting)])
            while waiting and idle:
                conn = idle.popleft()
                conn.scheduled = waiting.popleft()
                if conn.sock.send(request) != len(request):  # a few hundred bytes into an empty socket buffer
                    raise SystemExit(f"{url}: a request did not fit the socket's buffer")
                lags.append((clock() - start - conn.scheduled) * 1000)
                sent += 1
                busy += 1
            due = sent + len(waiting)
            timeout = schedule[due] - (clock() - start) if due < len(schedule) and idle else 1.0
            for key, _ in selector.select(max(timeout, 0)):
                conn = key.data
                data = conn.sock.recv(65536)
                if not data:
                    raise SystemExit(f"{url} closed a connection")
                conn.parser.feed_data(data)  # type: ignore[union-attr]
                if not conn.complete:
                    continue
                latencies.append((clock() - start - conn.scheduled) * 1000)
                status = conn.parser.get_status_code()  # type: ignore[union-attr]
                answer = b"".join(conn.body)
                if status != 200 or b'"error"' in answer:
                    raise SystemExit(f"{url} answered {status}: {answer[:300]!r}")
                conn.complete, conn.body = False, []
                busy -= 1
                idle.append(conn)
    finally:
        for key in list(selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        selector.close()
    return Result(len(latencies), seconds, latencies, lags)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("--rate", type=float, default=1000)
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--tool", default="echo")
    parser.add_argument("--tasks", action="store_true", help="declare the tasks extension (a task-creating call)")
    args = parser.parse_args()
    capabilities = {"extensions": {"io.modelcontextprotocol/tasks": {}}} if args.tasks else {}
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientCapabilities": capabilities}  # fmt: skip
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                       "params": {"name": args.tool, "arguments": {}, "_meta": meta}}).encode()  # fmt: skip
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream",
               "MCP-Protocol-Version": "2026-07-28", "Mcp-Method": "tools/call", "Mcp-Name": args.tool}  # fmt: skip
    result = run(args.url, body, headers, rate=args.rate, seconds=args.seconds, connections=args.connections)
    print(f"{result.requests} requests in {result.seconds:g} s: p50 {result.p50_ms:.3f} ms, p99 {result.p99_ms:.3f} "
          f"ms, max {max(result.latencies_ms):.3f} ms; send lag p99 {result.lag_p99_ms:.3f} ms, "
          f"median {statistics.median(result.send_lag_ms):.3f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
