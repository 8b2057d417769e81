"""The benchmark: pass-through overhead, the task path (memory and Redis), scale, a peer, and a stdio upstream, in
one run.

    python bench/run.py            # about 10 minutes on 2 cores; --quick for a shorter, noisier run

Everything runs on loopback in processes of their own, started and stopped here: a fast upstream
(bench/fast_upstream.py) and its stdio twin that the proxy starts (bench/fast_stdio.py), the minimal aiohttp
forwarder (bench/minimal_forwarder.py), mcp-tasks-proxy (memory and Redis stores), a redis-server, and the peer
(bench/peer_server.py: FastMCP with fastmcp-tasks, in a virtual environment of its own under bench/.peer-venv). Load
comes from wrk (Debian's package) with one thread. Figures are medians of interleaved repeats; on 2 shared cores
compare ratios measured side by side, not absolute values.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import itertools
import json
import math
import os
import platform
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PEER_VENV = HERE / ".peer-venv"
PEER_REQUIREMENT = "fastmcp-tasks==4.1.4"
PROTOCOL = "2026-07-28"
TASKS = "io.modelcontextprotocol/tasks"
META = {"io.modelcontextprotocol/protocolVersion": PROTOCOL, "io.modelcontextprotocol/clientCapabilities": {}}
META_TASKS = {**META, "io.modelcontextprotocol/clientCapabilities": {"extensions": {TASKS: {}}}}
WORK = Path(tempfile.mkdtemp(prefix="mcp-tasks-proxy-bench-"))
atexit.register(shutil.rmtree, WORK, ignore_errors=True)  # scripts, policies, logs: this run's alone


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_port(port: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"nothing listened on {port}")


@contextmanager
def process(*argv: str, port: int, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(
        list(argv), env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_port(port)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextmanager
def proxy(
    upstream: str | None, store: dict, *, protocol: str = "modern", command: list[str] | None = None, **extra: object
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A proxy in front of `upstream` (a URL), or of the stdio server it starts from `command`."""
    port = free_port()
    # 20,000 in flight on one stdio child: the scale figures hold 10,000 calls open on it (the default is 10,000).
    target = {"url": upstream} if command is None else {"command": command, "stdio": {"max_in_flight": 20_000}}
    policy = {
        "upstream": {**target, "protocol": protocol},
        "store": store,
        "tools": [{"match": "echo", "task": "optional"}, {"match": "hold"}, {"match": "ask"}],
        "tasks": {"max_tasks": 200_000},
        "limits": {"max_running_tasks": 20_000},
        "security": {"principal_key": "bench"},
        "logging": {"level": "warning", "format": "json"},
        **extra,
    }
    path = WORK / f"policy-{port}.json"  # JSON is YAML too
    path.write_text(json.dumps(policy))
    with process(
        sys.executable, "-m", "mcp_tasks_proxy", "--config", str(path), "--port", str(port), port=port
    ) as proc:
        wait_ready(port)
        url = f"http://127.0.0.1:{port}/mcp"
        if command is not None:  # one request served (the tools list) before anything is measured
            asyncio.run(_listed(url))
        yield url, proc


def wait_ready(port: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5):
                return
        except OSError as exc:  # HTTPError (503: not ready yet) is an OSError too
            if time.monotonic() > deadline:
                raise SystemExit(f"the proxy on {port} never became ready: {exc}") from None
            time.sleep(0.1)


async def _listed(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        answer = await rpc(session, url, "tools/list", {}, meta=META)
    if "result" not in answer:
        raise SystemExit(f"the stdio server did not list its tools: {answer}")


def request_headers(method: str, name: str | None = None) -> dict[str, str]:
    """The headers of a 2026-07-28 client's POST of `method`, with `Mcp-Name` when the request names something."""
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream",
               "MCP-Protocol-Version": PROTOCOL, "Mcp-Method": method}  # fmt: skip
    if name is not None:
        headers["Mcp-Name"] = name
    return headers


def body(method: str, params: dict, meta: dict) -> str:
    return json.dumps({"jsonrpc": "2.0", "id": 1, "method": method, "params": {**params, "_meta": meta}})


def wrk(
    url: str,
    method: str,
    params: dict,
    *,
    meta: dict,
    connections: int,
    seconds: float,
    name: str | None = None,
    rate: float | None = None,
):
    """req/s, p50 ms, p99 ms of one wrk run posting the same JSON-RPC request.

    Without `rate`, each connection sends its next request as soon as the last is answered (closed loop: what the
    server sustains, and latency that is mostly queueing). With `rate`, each connection waits an exponentially
    distributed pause after each answer, so that together they offer about `rate` requests/s: meant as Poisson
    arrivals, they come bunched, since wrk's timers fire on one thread's millisecond ticks (bench/arrivals.py;
    `poisson` below comes far nearer).
    """
    headers = request_headers(method, name)
    script = WORK / f"wrk-{abs(hash((method, json.dumps(params), rate)))}.lua"
    lines = ['wrk.method = "POST"', f"wrk.body = {json.dumps(body(method, params, meta))}"]
    lines += [f'wrk.headers["{key}"] = "{value}"' for key, value in headers.items()]
    if rate is not None:
        mean_pause_ms = connections * 1000 / rate
        lines.append(f"function delay() return -math.log(1 - math.random()) * {mean_pause_ms:.3f} end")
    script.write_text("\n".join(lines) + "\n")
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency", "-s", str(script), url],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    rate = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if errors:
        raise SystemExit(f"wrk saw {errors.group(1)} error responses from {url} ({method}):\n{out}")
    return rate, _latency(out, "50%"), _latency(out, "99%")


def _latency(out: str, percentile: str) -> float:
    match = re.search(rf"{percentile}\s+([\d.]+)(us|ms|s)\b", out)
    value, unit = float(match.group(1)), match.group(2)
    return value / 1000 if unit == "us" else value * 1000 if unit == "s" else value


def poisson(
    url: str, method: str, params: dict, *, meta: dict, seconds: float, rate: float, connections: int = 64,
    name: str | None = None, seed: int | None = None,
) -> tuple[float, float, float]:  # fmt: skip
    """req/s, p50 ms, p99 ms of the same JSON-RPC request offered in Poisson arrivals at `rate` requests/s.

    wrk's `delay()` cannot offer that: one thread's timers fire on millisecond ticks, so its arrivals come in bursts
    (bench/arrivals.py). Here each connection is an h2load process of its own (nghttp2's load generator, Debian's
    nghttp2-client) replaying a timing script drawn from an exponential distribution at `rate / connections`; the
    sum of independent Poisson processes is one at `rate`. Each request is timed from its send to the end of its
    answer (h2load's --log-file).

    What h2load does with a script, and how this keeps it honest: it waits for each next request with a timer
    re-armed at every send, which its event loop (libev on epoll) rounds up to a whole millisecond, so each gap
    comes out about 0.6 ms long and a connection falls behind its script as it goes; and a request due while its
    connection's previous one is unanswered is sent when that answer ends, its wait not counted in its time. Many
    connections at a low rate each keep both small (at 1,000/s over 64, a gap averages 64 ms); the share of requests
    so held is printed when it passes 2 %. A run whose connections took more than 105 % of their scripts' time is
    refused (about 0.6 ms a gap: 4 % at 16 connections and 1,000/s). The figures come from the window in which
    every connection is sending: from the last connection's first request plus 200 ms (the processes start one
    after another, and their start-up slows the first answers) to the first connection's last one; a window under
    40 % of `seconds` is refused. The req/s returned is every answer over `seconds`, as wrk counts (what a caller
    divides the CPU of the whole run by).
    """
    draw = random.Random(seed)
    headers = [f"{key}: {value}" for key, value in request_headers(method, name).items()]
    home = Path(tempfile.mkdtemp(prefix="poisson-", dir=WORK))
    runs: list[subprocess.Popen] = []
    scripts: list[list[float]] = []  # each connection's offsets, ms
    try:
        (home / "body.json").write_text(body(method, params, meta))
        for index in range(connections):
            moments, moment = [], 0.0
            while (moment := moment + draw.expovariate(rate / connections / 1000)) < seconds * 1000 or not moments:
                moments.append(round(moment, 3))  # (one at least: h2load refuses an empty script)
            scripts.append(moments)
            (home / f"script-{index}").write_text("".join(f"{moment:.3f}\t{url}\n" for moment in moments))
            command = ["h2load", "--h1", "-c1", f"--timing-script-file={home / f'script-{index}'}",
                       "-d", str(home / "body.json"), f"--log-file={home / f'log-{index}'}"]  # fmt: skip
            for header in headers:
                command += ["-H", header]
            runs.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        errors = [run.communicate(timeout=seconds * 2 + 30)[1] for run in runs]  # a stalled server: no figure
        failed = [error for run, error in zip(runs, errors, strict=True) if run.returncode != 0]
        if failed:
            raise SystemExit(f"h2load failed against {url}: {failed[0]}")
        # Per connection, (start µs since the epoch, duration µs) of each request, in the order sent.
        sent: list[list[tuple[int, int]]] = []
        statuses = set()
        for index in range(connections):
            rows = []
            for line in (home / f"log-{index}").read_text().splitlines():
                start, status, micros = line.split("\t")[:3]
                rows.append((int(start), int(micros)))
                statuses.add(status)
            sent.append(rows)  # in the order sent, which is the script's
    except subprocess.TimeoutExpired:
        raise SystemExit(f"h2load got no end of the answers from {url} within {seconds * 2 + 30:g} s") from None
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
                run.wait()
        shutil.rmtree(home, ignore_errors=True)
    answered, offered = sum(len(rows) for rows in sent), sum(len(moments) for moments in scripts)
    if statuses != {"200"} or answered != offered:
        raise SystemExit(f"{url} answered {answered} of {offered} {method} requests, with HTTP statuses "
                         f"{sorted(statuses)}: no figure for them")  # fmt: skip
    # How far the connections fell behind their scripts: the time their requests spanned as sent, against the
    # time the scripts gave them.
    scripted_ms = sum(moments[-1] - moments[0] for moments in scripts)
    took_ms = sum(rows[-1][0] - rows[0][0] for rows in sent) / 1000
    if took_ms > scripted_ms * 1.05:
        raise SystemExit(f"h2load took {took_ms / scripted_ms:.0%} of its scripts' time to send to {url}: "
                         f"{rate * scripted_ms / took_ms:.0f} requests/s, not {rate:g}: no figure for it")  # fmt: skip
    begin = max(rows[0][0] for rows in sent) + 200_000
    end = min(rows[-1][0] for rows in sent)
    window = sorted(micros / 1000 for rows in sent for start, micros in rows if begin <= start < end)
    if end - begin < seconds * 0.4 * 1e6:
        raise SystemExit(f"h2load's connections all sent to {url} for {(end - begin) / 1e6:.2f} s only: no figure")
    held = sum(1 for rows in sent for (start, micros), (later, _) in itertools.pairwise(rows)
               if later - (start + micros) < 100)  # fmt: skip
    if held > answered / 50:
        print(f"  ({held / answered:.1%} of the requests to {url} came due while their connection's previous one "
              "was unanswered: sent late, that wait not counted)", file=sys.stderr)  # fmt: skip
    return answered / seconds, window[math.ceil(len(window) * 0.5) - 1], window[math.ceil(len(window) * 0.99) - 1]


def median_runs(runs: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    return tuple(statistics.median(values) for values in zip(*runs, strict=True))  # type: ignore[return-value]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


RATE_LOADS = {"h2load": (poisson, 64), "wrk": (wrk, 16)}
"""A rate-limited load by its generator, and the connections it is run with: h2load over 64, so that each waits
long between its requests (`poisson`); wrk over 16, as the figures taken with it were."""


async def rpc(session: aiohttp.ClientSession, url: str, method: str, params: dict, meta: dict = META_TASKS) -> dict:
    headers = request_headers(method, params["taskId"] if "taskId" in params else params.get("name"))
    async with session.post(url, data=body(method, params, meta), headers=headers) as response:
        return await response.json()


async def create_tasks(url: str, tool: str, count: int, concurrency: int = 64) -> list[str]:
    ids: list[str] = []
    numbers = iter(range(count))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:

        async def worker() -> None:
            for _ in numbers:
                answer = await rpc(session, url, "tools/call", {"name": tool, "arguments": {}})
                ids.append(answer["result"]["taskId"])

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ids


async def update_round_trip(url: str, rounds: int) -> tuple[float, float]:
    """Median ms of the tasks/update ack, and of update → completed visible on tasks/get."""
    acks, completions = [], []
    answer = {"q": {"action": "accept", "content": {"a": "x"}}}
    async with aiohttp.ClientSession() as session:
        for _ in range(rounds):
            asking = {
                **META_TASKS,
                "io.modelcontextprotocol/clientCapabilities": {"extensions": {TASKS: {}}, "elicitation": {}},
            }
            created = await rpc(session, url, "tools/call", {"name": "ask", "arguments": {}}, meta=asking)
            task_id = created["result"]["taskId"]
            deadline = time.perf_counter() + 30
            while (await rpc(session, url, "tasks/get", {"taskId": task_id}))["result"]["status"] != "input_required":
                if time.perf_counter() > deadline:
                    raise SystemExit(f"task {task_id} never asked for input")
                await asyncio.sleep(0.001)
            started = time.perf_counter()
            await rpc(session, url, "tasks/update", {"taskId": task_id, "inputResponses": answer})
            acks.append((time.perf_counter() - started) * 1000)
            while (status := (await rpc(session, url, "tasks/get", {"taskId": task_id}))["result"]["status"]) in (
                "working",
                "input_required",
            ):
                if time.perf_counter() - started > 30:
                    raise SystemExit(f"task {task_id} did not finish after tasks/update")
            if status != "completed":
                raise SystemExit(f"task {task_id} ended {status} after tasks/update")
            completions.append((time.perf_counter() - started) * 1000)
    return statistics.median(acks), statistics.median(completions)


def table(title: str, header: list[str], rows: list[list[str]]) -> None:
    print(f"\n### {title}\n", flush=True)
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |", flush=True)


def passthrough(upstream: str, seconds: float, repeats: int) -> None:
    forwarder_port = free_port()
    forwarder = (sys.executable, str(HERE / "minimal_forwarder.py"), str(forwarder_port), upstream)
    with process(*forwarder, port=forwarder_port), proxy(upstream, {"backend": "memory"}) as (proxy_url, _):
        targets = {
            "direct": upstream,
            "minimal forwarder": f"http://127.0.0.1:{forwarder_port}/mcp",
            "mcp-tasks-proxy": proxy_url,
        }
        rows = []
        for connections in (1, 16, 64):
            runs: dict[str, list] = {name: [] for name in targets}
            for _ in range(repeats):
                for name, url in targets.items():  # interleaved: each target sees the same machine noise
                    runs[name].append(wrk(url, "tools/call", {"name": "plain", "arguments": {}}, meta=META,
                                          connections=connections, seconds=seconds, name="plain"))  # fmt: skip
            medians = {name: median_runs(r) for name, r in runs.items()}
            floor, ours = medians["minimal forwarder"], medians["mcp-tasks-proxy"]
            for name, (rate, p50, p99) in medians.items():
                ratio = f"{rate / floor[0]:.2f}x" if name != "direct" else ""
                rows.append([str(connections), name, f"{rate:.0f}", f"{p50:.2f}", f"{p99:.2f}", ratio])
            print(f"  c={connections}: proxy/forwarder throughput {ours[0] / floor[0]:.2f}x", file=sys.stderr)
    table("Pass-through (a tools/call the policy does not make a task)",
          ["concurrency", "target", "req/s", "p50 ms", "p99 ms", "vs minimal forwarder"], rows)  # fmt: skip


def task_path(upstream: str, redis_url: str, seconds: float, repeats: int, peer_url: str | None) -> None:
    rows = []
    stores = {"memory": {"backend": "memory"}, "redis": {"backend": "redis", "url": redis_url, "key_prefix": "bench:"}}
    for name, store in stores.items():
        with proxy(upstream, store) as (url, _):
            rows.append([name, *task_figures(url, seconds, repeats, update=True)])
    if peer_url is not None:
        rows.append(["fastmcp-tasks (peer)", *task_figures(peer_url, seconds, repeats, update=False)])
    table(f"Task path (the tool answers at once upstream; 16 clients create tasks at {PACED_RATE:,}/s, then as fast as "
          "they can)",
          ["server", "CreateTaskResult p50 ms", "p99 ms", "at (req/s)", "saturated: creations/s", "p50 ms",
           "p99 ms", "tasks/get req/s (c16)", "tasks/get req/s (c64)", "tasks/update ack ms",
           "update → completed ms"], rows)  # fmt: skip


PACED_RATE = 1_000
"""Task creations per second offered by 16 clients for the latency figures: a heavy load (tasks are for calls that
run for seconds or longer) that leaves the 2 cores, shared by the load generator, the upstream and the proxy, room."""


def task_figures(url: str, seconds: float, repeats: int, *, update: bool) -> list[str]:
    echo = {"name": "echo", "arguments": {}}
    paced = median_runs([wrk(url, "tools/call", echo, meta=META_TASKS, connections=16, seconds=seconds, name="echo",
                             rate=PACED_RATE) for _ in range(repeats)])  # fmt: skip
    create = median_runs([wrk(url, "tools/call", echo, meta=META_TASKS, connections=16, seconds=seconds, name="echo")
                          for _ in range(repeats)])  # fmt: skip
    task_id = asyncio.run(create_tasks(url, "echo", 1, concurrency=1))[0]
    time.sleep(1)  # let it complete: what is measured is reading a finished task
    get16 = median_runs([wrk(url, "tasks/get", {"taskId": task_id}, meta=META_TASKS, connections=16,
                             seconds=seconds, name=task_id) for _ in range(repeats)])  # fmt: skip
    get64 = median_runs([wrk(url, "tasks/get", {"taskId": task_id}, meta=META_TASKS, connections=64,
                             seconds=seconds, name=task_id) for _ in range(repeats)])  # fmt: skip
    ack, completed = asyncio.run(update_round_trip(url, 100)) if update else (float("nan"), float("nan"))
    return [f"{paced[1]:.2f}", f"{paced[2]:.2f}", f"{paced[0]:.0f}", f"{create[0]:.0f}", f"{create[1]:.2f}",
            f"{create[2]:.2f}", f"{get16[0]:.0f}", f"{get64[0]:.0f}",
            "n/a" if not update else f"{ack:.2f}", "n/a" if not update else f"{completed:.2f}"]  # fmt: skip


def scale(upstream_port: int, seconds: float, working: int, stored: int) -> None:
    upstream = f"http://127.0.0.1:{upstream_port}/mcp"
    rows = []
    for protocol in ("modern", "legacy"):
        with proxy(upstream, {"backend": "memory"}, protocol=protocol) as (url, proc):
            idle = rss_mb(proc.pid)
            held = asyncio.run(create_tasks(url, "hold", working))
            time.sleep(1)
            era = "2026-07-28" if protocol == "modern" else "legacy 2025-11-25"
            rows.append([f"{working:,} working, {era} upstream (their calls open)", f"{rss_mb(proc.pid):.0f}",
                         f"{idle:.0f}", *[f"{v:.2f}" for v in wrk(url, "tasks/get", {"taskId": held[0]},
                                                                  meta=META_TASKS, connections=16, seconds=seconds,
                                                                  name=held[0])[1:]]])  # fmt: skip
            asyncio.run(_release(upstream_port))
    with proxy(upstream, {"backend": "memory"}) as (url, proc):
        growth = []
        done = 0
        for checkpoint in (1_000, 10_000, stored):
            ids = asyncio.run(create_tasks(url, "echo", checkpoint - done))
            done = checkpoint
            time.sleep(1)
            rate, p50, p99 = wrk(url, "tasks/get", {"taskId": ids[0]}, meta=META_TASKS, connections=16,
                                 seconds=seconds, name=ids[0])  # fmt: skip
            growth.append(
                [f"{checkpoint:,} stored", f"{rss_mb(proc.pid):.0f}", "", f"{p50:.2f}", f"{p99:.2f}", f"{rate:.0f}"]
            )
    for row in rows:
        row.append("")
    header = ["tasks", "proxy RSS MB", "RSS idle MB", "tasks/get p50 ms", "p99 ms", "tasks/get req/s"]
    table("Scale (memory store; tasks/get at concurrency 16)", header, rows + growth)


def stdio(upstream: str, seconds: float, repeats: int, working: int) -> None:
    """The same fast server behind the proxy over HTTP (bench/fast_upstream.py) and as its stdio child
    (bench/fast_stdio.py), side by side: what the stdio transport costs or saves on pass-through, on task creation,
    and in memory per working task (the upstream's own RSS counted too: a stdio child holds every open call)."""
    command = [sys.executable, str(HERE / "fast_stdio.py")]
    rows = []
    store = {"backend": "memory"}
    with proxy(upstream, store) as (http_url, _), proxy(None, store, command=command) as (stdio_url, _):
        targets = {"HTTP": http_url, "stdio": stdio_url}
        for label, tool, meta, counts in (("pass-through tools/call", "plain", META, (1, 16, 64)),
                                          ("task creation (saturated)", "echo", META_TASKS, (16,))):  # fmt: skip
            for connections in counts:
                runs: dict[str, list] = {name: [] for name in targets}
                for _ in range(repeats):
                    for name, url in targets.items():  # interleaved: both see the same machine noise
                        runs[name].append(wrk(url, "tools/call", {"name": tool, "arguments": {}}, meta=meta,
                                              connections=connections, seconds=seconds, name=tool))  # fmt: skip
                http, child = median_runs(runs["HTTP"]), median_runs(runs["stdio"])
                rate = "creations/s" if tool == "echo" else "req/s"
                for what, h, c, digits in ((rate, http[0], child[0], 0), ("p50 ms", http[1], child[1], 2),
                                           ("p99 ms", http[2], child[2], 2)):  # fmt: skip
                    rows.append([f"{label}, c{connections}: {what}", f"{h:.{digits}f}", f"{c:.{digits}f}",
                                 f"{c / h:.2f}x"])  # fmt: skip
                print(f"  {label} c={connections}: stdio/HTTP throughput {child[0] / http[0]:.2f}x", file=sys.stderr)
    memory: dict[str, tuple[float, float, float, float]] = {}
    for name in ("HTTP", "stdio"):
        over_http = name == "HTTP"
        with proxy(upstream if over_http else None, store, command=None if over_http else command) as (url, proc):
            # The upstream's RSS too: over stdio the child holds the open calls that fast_upstream holds over HTTP.
            server = (
                find_pid(f"fast_upstream.py\0{_port(upstream)}") if over_http else find_pid("fast_stdio.py", proc.pid)
            )
            idle, server_idle = rss_mb(proc.pid), rss_mb(server)
            held = asyncio.run(create_tasks(url, "hold", working))
            time.sleep(1)
            memory[name] = (idle, rss_mb(proc.pid), server_idle, rss_mb(server))
            if over_http:
                asyncio.run(_release(_port(upstream)))
            else:
                asyncio.run(_release_stdio(url))
            asyncio.run(_completed(url, [held[0], held[-1]]))
    (http_idle, http_busy, http_server_idle, http_server_busy) = memory["HTTP"]
    (idle, busy, server_idle, server_busy) = memory["stdio"]
    per_task = (
        ("proxy KB per working task", (http_busy - http_idle), (busy - idle)),
        ("proxy + upstream KB per working task", (http_busy - http_idle + http_server_busy - http_server_idle),
         (busy - idle + server_busy - server_idle)),
    )  # fmt: skip
    for what, h, c in (("proxy RSS idle MB", http_idle, idle), (f"proxy RSS, {working:,} working MB", http_busy, busy),
                       ("upstream RSS idle MB", http_server_idle, server_idle),
                       (f"upstream RSS, {working:,} working MB", http_server_busy, server_busy)):  # fmt: skip
        rows.append([what, f"{h:.0f}", f"{c:.0f}", f"{c / h:.2f}x"])
    for what, h, c in per_task:
        h, c = h * 1024 / working, c * 1024 / working
        rows.append([what, f"{h:.1f}", f"{c:.1f}", f"{c / h:.2f}x" if h > 0 else ""])
    table(f"stdio upstream (the proxy starts bench/fast_stdio.py) vs HTTP (bench/fast_upstream.py); memory store, "
          f"{working:,} working `hold` tasks; in a full run the HTTP upstream served the sections before",
          ["figure", "HTTP upstream", "stdio child", "stdio / HTTP"], rows)  # fmt: skip


def _port(url: str) -> int:
    return int(url.split(":")[2].split("/")[0])


def find_pid(needle: str, parent: int | None = None) -> int:
    """The process whose argv (NUL-separated) contains `needle` (and whose parent is `parent`, if given)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if needle in argv and (parent is None or ppid == parent):
            return int(entry.name)
    raise SystemExit(f"no process runs {needle!r}")


async def _release_stdio(url: str) -> None:
    """A pass-through tools/call of `release`: the stdio child answers every `hold` waiting now."""
    async with aiohttp.ClientSession() as session:
        answer = await rpc(session, url, "tools/call", {"name": "release", "arguments": {}}, meta=META)
    if "result" not in answer:
        raise SystemExit(f"release failed: {answer}")


async def _completed(url: str, task_ids: list[str], timeout_s: float = 60) -> None:
    """Wait until the released tasks are seen completed (the release reached them)."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        for task_id in task_ids:
            while (status := (await rpc(session, url, "tasks/get", {"taskId": task_id}))["result"]["status"]) != (
                "completed"
            ):
                if status != "working" or time.monotonic() > deadline:
                    raise SystemExit(f"held task {task_id} is {status} after the release")
                await asyncio.sleep(0.05)


async def _release(port: int) -> None:
    async with aiohttp.ClientSession() as session, session.post(f"http://127.0.0.1:{port}/release") as response:
        await response.read()


def peer_python() -> Path | None:
    python = PEER_VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(PEER_VENV)], check=True)
        done = subprocess.run([str(python), "-m", "pip", "install", "--quiet", PEER_REQUIREMENT])
        if done.returncode != 0:
            print("could not install the peer; its row is left out", file=sys.stderr)
            return None
    return python


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 s runs, 1 repeat, smaller scale (for a smoke test)")
    parser.add_argument("--sections", default="passthrough,tasks,scale,stdio", help="comma-separated subset")
    args = parser.parse_args()
    seconds, repeats = (1, 1) if args.quick else (4, 3)
    working, stored = (1_000, 20_000) if args.quick else (10_000, 100_000)
    for tool in ("wrk", "redis-server"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is needed: apt-get install {tool}")
    print(f"# {datetime.now(UTC):%Y-%m-%d} · {platform.machine()} · {os.cpu_count()} cores · "
          f"{platform.python_implementation()} {platform.python_version()} · wrk -t1, {seconds} s runs, "
          f"median of {repeats} ({'1' if args.quick else '5'} for pass-through and stdio)")  # fmt: skip
    sections = set(args.sections.split(","))
    upstream_port, redis_port = free_port(), free_port()
    upstream = f"http://127.0.0.1:{upstream_port}/mcp"
    with (
        process(sys.executable, str(HERE / "fast_upstream.py"), str(upstream_port), port=upstream_port),
        process("redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                port=redis_port),
    ):  # fmt: skip
        if "passthrough" in sections:
            # Ratios at concurrency 1 swing most with the machine's noise (each request waits on three processes
            # waking in turn): pass-through takes more repeats.
            passthrough(upstream, seconds, repeats if args.quick else 5)
        if "tasks" in sections:
            python = peer_python()
            peer_port = free_port()
            if python is not None:
                with process(str(python), str(HERE / "peer_server.py"), str(peer_port), port=peer_port):
                    task_path(
                        upstream,
                        f"redis://127.0.0.1:{redis_port}/0",
                        seconds,
                        repeats,
                        f"http://127.0.0.1:{peer_port}/mcp",
                    )
            else:
                task_path(upstream, f"redis://127.0.0.1:{redis_port}/0", seconds, repeats, None)
        if "scale" in sections:
            scale(upstream_port, seconds, working, stored)
        if "stdio" in sections:
            stdio(upstream, seconds, repeats if args.quick else 5, working)


if __name__ == "__main__":
    main()
