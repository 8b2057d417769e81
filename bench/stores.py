"""Task-store benchmark: CreateTaskResult latency and tasks/get throughput, memory and Redis side by side.

Run: python bench/stores.py [--requests 2000] [--concurrency 16]
It starts everything it needs on loopback (a fake upstream that answers at once, in this process with the load
generator; a redis-server; the proxy in a process of its own for each store), measures over real HTTP, prints a
table, and stops what it started. Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime

import aiohttp
from aiohttp import web

TASKS = "io.modelcontextprotocol/tasks"
META = {
    "io.modelcontextprotocol/protocolVersion": "2026-07-28",
    "io.modelcontextprotocol/clientCapabilities": {"extensions": {TASKS: {}}},
}
HEADERS = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream",
           "MCP-Protocol-Version": "2026-07-28"}  # fmt: skip


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def start_upstream() -> tuple[web.AppRunner, str]:
    async def handler(request: web.Request) -> web.Response:
        message = await request.json()
        if message.get("method") == "server/discover":
            result = {"resultType": "complete", "supportedVersions": ["2026-07-28"], "capabilities": {}}
        else:
            result = {"resultType": "complete", "content": [{"type": "text", "text": "ok"}]}
        return web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": result})

    app = web.Application()
    app.router.add_post("/mcp", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}/mcp"


async def start_proxy(upstream: str, store: dict, workdir: str) -> tuple[subprocess.Popen[bytes], str]:
    """The proxy in a process of its own, as deployed, so the load generator does not share its event loop."""
    port = free_port()
    policy = {
        "upstream": {"url": upstream, "protocol": "modern"},
        "store": store,
        "tools": [{"match": "*"}],
        "tasks": {"max_tasks": 1_000_000},
        "logging": {"level": "error", "format": "json"},
    }
    path = f"{workdir}/policy-{port}.json"  # JSON is YAML too
    with open(path, "w") as file:
        json.dump(policy, file)
    process = subprocess.Popen([sys.executable, "-m", "proxy", "--config", path, "--port", str(port)])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            await asyncio.sleep(0.1)
    return process, f"http://127.0.0.1:{port}/mcp"


async def post(session: aiohttp.ClientSession, url: str, method: str, params: dict, rid: int) -> dict:
    body = {"jsonrpc": "2.0", "id": rid, "method": method, "params": {**params, "_meta": META}}
    async with session.post(url, data=json.dumps(body), headers={**HEADERS, "Mcp-Method": method}) as response:
        return await response.json()


async def measure(url: str, requests: int, concurrency: int) -> dict[str, float]:
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        latencies: list[float] = []
        task_ids: list[str] = []
        queue = iter(range(requests))

        async def create_worker() -> None:
            for n in queue:
                started = time.perf_counter()
                answer = await post(session, url, "tools/call", {"name": "job", "arguments": {}}, n)
                latencies.append((time.perf_counter() - started) * 1000)
                task_ids.append(answer["result"]["taskId"])

        await asyncio.gather(*(create_worker() for _ in range(concurrency)))
        gets = iter(range(requests))

        async def get_worker() -> None:
            for n in gets:
                await post(session, url, "tasks/get", {"taskId": task_ids[n % len(task_ids)]}, n)

        started = time.perf_counter()
        await asyncio.gather(*(get_worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    latencies.sort()
    return {
        "create_p50_ms": statistics.median(latencies),
        "create_p99_ms": latencies[int(len(latencies) * 0.99) - 1],
        "get_per_s": requests / elapsed,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="runs per store; the table shows medians")
    args = parser.parse_args()

    upstream_runner, upstream = await start_upstream()
    workdir = tempfile.mkdtemp(prefix="mcp-tasks-proxy-bench-")
    redis_port = free_port()
    redis_binary = shutil.which("redis-server")
    if redis_binary is None:
        raise SystemExit("redis-server is needed (apt-get install redis-server)")
    redis = subprocess.Popen([redis_binary, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no"], stdout=subprocess.DEVNULL)  # fmt: skip
    try:
        await asyncio.sleep(0.5)
        stores = {
            "memory": {"backend": "memory"},
            "redis": {"backend": "redis", "url": f"redis://127.0.0.1:{redis_port}/0"},
        }
        rows: dict[str, dict[str, float]] = {}
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in stores}
        for _ in range(args.repeats):
            for name, store in stores.items():  # interleaved, so both see the same machine noise
                proxy, url = await start_proxy(upstream, store, workdir)
                try:
                    runs[name].append(await measure(url, args.requests, args.concurrency))
                finally:
                    proxy.terminate()
                    proxy.wait()
        for name, results in runs.items():
            rows[name] = {key: statistics.median(r[key] for r in results) for key in results[0]}
    finally:
        redis.terminate()
        redis.wait()
        await upstream_runner.cleanup()

    print(f"# {datetime.now(UTC):%Y-%m-%d}, {platform.machine()}, {platform.python_implementation()} "
          f"{platform.python_version()}, {args.requests} requests at concurrency {args.concurrency}, "
          f"median of {args.repeats}")  # fmt: skip
    print("| store | CreateTaskResult p50 (ms) | CreateTaskResult p99 (ms) | tasks/get per s |")
    print("| --- | --- | --- | --- |")
    for name, row in rows.items():
        print(f"| {name} | {row['create_p50_ms']:.2f} | {row['create_p99_ms']:.2f} | {row['get_per_s']:.0f} |")


if __name__ == "__main__":
    asyncio.run(main())
