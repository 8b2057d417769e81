"""A/B: the proxy of a commit against the work tree's, interleaved in one run, by CPU time per request.

    python bench/ab.py                    # the work tree against HEAD
    python bench/ab.py --base 1d897d4     # against any commit
    python bench/ab.py --quick            # 2 s runs, 3 repeats: a smoke test, not a figure
    python bench/ab.py --path create      # task creation at 1,000/s instead of pass-through (memory and Redis)
    python bench/ab.py --path get         # tasks/get of a finished task, closed loop (memory and Redis)
    python bench/ab.py --path discover    # server/discover, the proxy's, answered by the application's handler
    python bench/ab.py --path stdio       # pass-through to a stdio server each proxy starts (bench/fast_stdio.py)
    python bench/ab.py --client tasks     # pass-through from a client that declares the tasks extension
    python bench/ab.py --variant tracing  # the work tree plain (A) against itself with tracing configured (B)
    python bench/ab.py --variant tracing-ratio  # the same with a sampler that may begin traces of its own
    python bench/ab.py --variant jwt      # the same with every request's bearer token verified
    python bench/ab.py --variant rates    # the same with every request counted against a rate limit in Redis
    python bench/ab.py --variant rates-memory  # the same limit counted by the replica alone (the memory store)
    python bench/ab.py --variant concurrency  # the same with every call holding a slot of a limit in Redis
    python bench/ab.py --variant concurrency-memory  # the same slots counted by the replica alone

Both proxies stand in front of one fast upstream (bench/fast_upstream.py), beside the bare aiohttp forwarder
(bench/minimal_forwarder.py) and, when it is installed, nginx, for an upstream of each era (the proxy translates a
2026 client's calls for a 2025 one). For each concurrency every repeat runs each target once, in an order that
rotates, with wrk posting the same pass-through tools/call; the figure is the CPU time (utime + stime from /proc)
the target's process spent per request served. On a shared, noisy machine that moves far less than throughput, and
each target sees the same noise. Medians, with the spread (min-max) of the repeats. The client declares nothing by
default; with `--client tasks` it declares the tasks extension in every request, as a tasks-capable client does,
and the proxy removes the declaration from what it relays (the upstream must not make tasks of its own).

`--path create` measures task creation instead: each proxy (a task rule for `echo`, the memory store, then Redis,
with the operator's key so that calls are kept sealed for a takeover as deployed) gets `tools/call` with the tasks
extension at 1,000 requests/s; the figures are CPU µs per creation and the p99 latency of the `CreateTaskResult`,
A and B interleaved in the same way (a run in which a proxy made fewer tasks than it answered calls is refused).
Beside them is the p99 of the fast upstream answering a tools/call itself at the same rate: what an aiohttp server
that does nothing else achieves on the machine. The arrivals are Poisson, from one h2load process per connection
over 64 connections (`--arrivals h2load`, the default: bench/run.py `poisson`); `--arrivals wrk` offers them over
16 through wrk's `delay()`, as the earlier figures of docs/benchmarks.md were measured: its timers fire on
millisecond ticks of one thread, so that requests come in small bursts and one wake-up serves several
(bench/arrivals.py compares the two).

`--path get` measures the proxy's own read path: each proxy makes one task (which completes at once), then wrk
asks tasks/get for it with every connection count, closed loop; the figures are CPU µs per tasks/get and req/s.

`--path discover` measures a request the proxy answers through the application's handler (aiohttp's request and
response objects, proxy/front/dispatch.py) rather than the lane's own code: a 2026 client's server/discover,
closed loop, memory store.

`--path stdio` measures the pass-through tools/call through a stdio child: each proxy starts bench/fast_stdio.py
(the fast upstream's stdio twin) and relays to it, closed loop, memory store; the figures are CPU µs per request of
the proxy's process (the child's own CPU not counted) and req/s.

`--variant tracing` and `--variant advertise` compare configurations instead of commits: A is the work tree as
configured above, B the same install with OpenTelemetry tracing configured (an OTLP exporter, the sampler
`parentbased_always_off`: a span is recorded only when a client's context asks for it, and none does here) or with
`listen.advertise_url` set (replicas routing 2025 sessions, over a Redis store in both), or with verified callers
(`--variant jwt`: `security.principal: jwt` with a JWKS file; every request carries the same valid token, which A
forwards unread and B checks: verified once, then kept until it expires), or with a rate limit (`--variant rates`: one
per caller, far above the load, so that every request is counted in Redis and none refused; `--variant concurrency`:
a limit on calls at once per caller, so that every call takes a slot in Redis and gives it back). Configuration
should move no traffic onto other code: B/A near 1. `--variant tracing-ratio` configures `parentbased_traceidratio`
at a ratio of 0 instead: a sampler that may begin a trace of its own, so that the SDK makes each request's span
(unsampled, here) to ask it; that is OpenTelemetry's cost per request, not the proxy's.

The base commit is installed once into a virtual environment of its own under bench/.ab/ (from `git archive`, so
the work tree is untouched), and the work tree, as it is now (its tracked and untracked files, not the ignored ones),
into another, bench/.ab/worktree/, afresh at every run: both proxies run from a regular install in a virtual
environment of their own, so that how each was installed cannot weigh on one side (the editable install B once ran
from read about 2 % high at one connection in A/A runs).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CACHE = HERE / ".ab"
sys.path.insert(0, str(HERE))
from run import META, META_TASKS, RATE_LOADS, create_tasks, free_port, process, request_headers, rpc, wait_ready  # noqa: E402  (bench/ is a folder of scripts)

WORK = Path(tempfile.mkdtemp(prefix="mcp-tasks-proxy-ab-"))
atexit.register(shutil.rmtree, WORK, ignore_errors=True)  # scripts, policies, logs: this run's alone
TICKS = os.sysconf("SC_CLK_TCK")
HEADERS = request_headers("tools/call", "plain")
BENCH_ISSUER, BENCH_RESOURCE = "https://issuer.bench", "https://mcp.bench/mcp"


def bench_token() -> str:
    """A bearer token for --variant jwt (RS256, valid for a day); its JWKS written where the policy reads it."""
    import jwt  # the proxy's own dependency
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwk = {**json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key())), "kid": "bench", "use": "sig"}
    (WORK / "jwks.json").write_text(json.dumps({"keys": [jwk]}))
    now = int(time.time())
    claims = {"iss": BENCH_ISSUER, "aud": BENCH_RESOURCE, "sub": "bench", "iat": now, "exp": now + 86_400}
    return jwt.encode(claims, key, algorithm="RS256", headers={"kid": "bench"})


Install = tuple[Path, str]
"""A proxy installed in a virtual environment of its own: the environment's interpreter, and the name the
package imports as."""


def package_of(tree: Path) -> str:
    """The import name of the proxy installed from a tree (it was `proxy` before it had one of its own)."""
    return "mcp_tasks_proxy" if '"mcp_tasks_proxy" = "proxy"' in (tree / "pyproject.toml").read_text() else "proxy"


def base_python(commit: str) -> Install:
    """The interpreter of a virtual environment holding `commit`'s proxy (made once, then reused), and the name
    its package imports as."""
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", commit], capture_output=True, text=True, check=True)
    sha_text = sha.stdout.strip()
    home = CACHE / sha_text[:12]
    python = home / "venv" / "bin" / "python"
    source = home / "src"
    if not python.exists():
        shutil.rmtree(home, ignore_errors=True)
        source.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", sha_text], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(source)], input=archive.stdout, check=True)
        subprocess.run([sys.executable, "-m", "venv", str(home / "venv")], check=True)
        print(f"installing {sha_text[:12]} into {home / 'venv'} ...", file=sys.stderr)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", str(source)], check=True)
    return python, package_of(source)


def worktree_python() -> Install:
    """The interpreter of a virtual environment holding the work tree's proxy as it is now, installed afresh (its
    dependencies stay between runs), and the name its package imports as."""
    home = CACHE / "worktree"
    python = home / "venv" / "bin" / "python"
    source = home / "src"
    shutil.rmtree(source, ignore_errors=True)
    source.mkdir(parents=True)
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, check=True)  # fmt: skip
    for name in filter(None, listed.stdout.decode().split("\0")):
        origin = ROOT / name
        if origin.is_file():  # a tracked file deleted in the work tree is not part of it
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(origin, source / name)
    stamp = home / "pyproject.toml"  # what the dependencies were installed from
    fresh = not python.exists() or not stamp.exists() or stamp.read_bytes() != (source / "pyproject.toml").read_bytes()
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(home / "venv")], check=True)
    print(f"installing the work tree into {home / 'venv'} ...", file=sys.stderr)
    if fresh:  # the dependencies again only when pyproject.toml changed
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", str(source)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--force-reinstall", "--no-deps", str(source)],
                   check=True)  # fmt: skip
    shutil.copy2(source / "pyproject.toml", stamp)
    return python, package_of(source)


def same_sources(installed: Path, tree: Path) -> bool:
    """Whether the package installed at `installed` holds exactly the Python files of the source folder `tree`."""

    def sources(root: Path) -> dict[str, bytes]:
        return {str(path.relative_to(root)): path.read_bytes() for path in root.rglob("*.py")}

    return sources(installed) == sources(tree)


_MEASURED_WITH = ("aiohttp", "httptools", "uvloop", "orjson", "multidict", "yarl", "pydantic", "structlog", "redis",
                  "hiredis", "prometheus_client")  # fmt: skip
"""What the proxy runs on: a comparison of two trees means little if these differ between A's and B's installs."""


def dependency_versions(python: Path | str) -> dict[str, str]:
    """The versions of the proxy's runtime dependencies in the virtual environment of `python`."""
    script = "import importlib.metadata as m, json, sys; print(json.dumps({n: m.version(n) for n in sys.argv[1:]}))"
    done = subprocess.run([str(python), "-c", script, *_MEASURED_WITH], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def imported_from(python: Path | str, package: str) -> Path:
    """Where `python -P -m package` imports the proxy from, exactly as the measured process will."""
    done = subprocess.run([str(python), "-P", "-c", f"import {package}; print({package}.__file__)"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return Path(done.stdout.strip()).resolve().parent


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def wrk_total(
    url: str,
    pid: int,
    connections: int,
    seconds: int,
    task_id: str | None = None,
    meta: dict = META,
    method: str = "tools/call",
) -> tuple[int, float]:
    """Requests wrk completed against `url` (every one a 2xx, or the run is void), and the CPU seconds the process
    `pid` spent meanwhile: the pass-through tools/call with `meta`, tasks/get of `task_id`, or `method` with
    `meta` alone."""
    if task_id is not None:
        method, params = "tasks/get", {"taskId": task_id, "_meta": META_TASKS}
        headers = request_headers(method, task_id)
    elif method == "tools/call":
        params, headers = {"name": "plain", "arguments": {}, "_meta": meta}, HEADERS
    else:
        params, headers = {"_meta": meta}, request_headers(method)
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": method, "params": params})
    # wrk counts a JSON-RPC error on HTTP 200 as served: one request first, read here, voids a run of errors.
    check = urllib.request.Request(url, data=body.encode(), headers=headers, method="POST")
    with urllib.request.urlopen(check, timeout=10) as response:
        answer = json.loads(response.read())
    if "result" not in answer:
        raise SystemExit(f"{url} answers the measured request with {answer}: no figure for it")
    script = WORK / (f"{method.replace('/', '-')}.lua" if task_id is None else f"get-{task_id}.lua")
    lines = ['wrk.method = "POST"', f"wrk.body = {json.dumps(body)}"]
    lines += [f'wrk.headers["{key}"] = "{value}"' for key, value in headers.items()]
    script.write_text("\n".join(lines) + "\n")
    before = cpu_s(pid)
    done = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "-s", str(script), url],
                          capture_output=True, text=True)  # fmt: skip
    spent = cpu_s(pid) - before
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", done.stdout)
    if done.returncode != 0 or errors:
        raise SystemExit(f"wrk failed against {url}:\n{done.stdout}{done.stderr}")
    return int(re.search(r"(\d+) requests in", done.stdout).group(1)), spent


def finished_task(url: str) -> str:
    """The id of a task made through the proxy at `url` (echo answers at once), once it is completed: asked with
    tasks/get as wrk will ask, so that an error (no such task for this caller) voids the run instead of its figures."""
    task_id = asyncio.run(create_tasks(url, "echo", 1, concurrency=1))[0]

    async def completed() -> str:
        async with aiohttp.ClientSession() as session:
            for _ in range(100):
                if (await rpc(session, url, "tasks/get", {"taskId": task_id}))["result"]["status"] == "completed":
                    return task_id
                await asyncio.sleep(0.05)
        raise SystemExit(f"the task made through {url} did not complete")

    return asyncio.run(completed())


@contextmanager
def proxy(
    python: Path | str,
    package: str,
    upstream: str | list[str],
    protocol: str,
    store: dict | None = None,
    ttl_ms: int = 60_000,
    log_level: str = "warning",
    variant: str | None = None,
    redis_url: str | None = None,
) -> Iterator[tuple[str, int]]:
    port = free_port()
    # A URL, or the command of a stdio server the proxy starts (as many calls in flight on it as a run makes).
    where = (
        {"url": upstream} if isinstance(upstream, str) else {"command": upstream, "stdio": {"max_in_flight": 20_000}}
    )
    policy = {
        "upstream": {**where, "protocol": protocol},
        "tools": [{"match": "echo", "task": "optional"}],  # a policy as deployed; a pass-through call is not in it
        "security": {"principal_key": "bench"},
        "logging": {"level": log_level, "format": "json"},  # to /dev/null (run.process)
    }
    if store is not None:  # the task paths: room for every task a run makes, each kept `ttl_ms`
        policy["store"] = {**store, "key_prefix": f"ab{port}:"} if store["backend"] == "redis" else store
        policy["tasks"] = {"max_tasks": 200_000, "ttl_ms": ttl_ms}
        policy["limits"] = {"max_running_tasks": 20_000}
    env: dict[str, str] = {}
    if variant is not None:  # both sides of a --variant run share the Redis store; B adds the variant
        policy["store"] = {"backend": "redis", "url": redis_url, "key_prefix": f"ab{port}:"}
    if variant == "advertise":
        policy["listen"] = {"advertise_url": f"http://127.0.0.1:{port}"}
    elif variant in ("rates", "rates-memory"):  # one limit per caller, far above the load: every request counted
        policy["limits"] = {"rates": [{"per": "caller", "requests_per_s": 1_000_000, "burst": 1_000_000}]}
        if variant == "rates-memory":  # counted by the replica alone (the pass-through path reads no other store)
            policy["store"] = {"backend": "memory"}
    elif variant in ("concurrency", "concurrency-memory"):  # calls at once per caller, far above the load
        policy["limits"] = {"rates": [{"per": "caller", "concurrency": 1_000_000}]}
        if variant == "concurrency-memory":
            policy["store"] = {"backend": "memory"}
    elif variant == "jwt":  # every request's token checked: verified once, then kept until it expires
        policy["security"] |= {"principal": "jwt", "resource_url": BENCH_RESOURCE,
                               "jwt": {"jwks_file": str(WORK / "jwks.json"), "issuer": BENCH_ISSUER}}  # fmt: skip
    elif variant in ("tracing", "tracing-ratio"):  # an exporter to a port nobody listens on
        # (always_off turns tracing off altogether: proxy/tracing.py configure)
        env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}",
               "OTEL_TRACES_SAMPLER": "parentbased_always_off"}  # fmt: skip
        if variant == "tracing-ratio":  # ratio 0: every root is asked about and none sampled, nothing exported
            env |= {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}
    path = WORK / f"policy-{port}.json"
    path.write_text(json.dumps(policy))
    # -P: the working directory (the repository) must not shadow the interpreter's own install of the proxy.
    with process(str(python), "-P", "-m", package, "--config", str(path), "--port", str(port), port=port,
                 env=env) as proc:  # fmt: skip
        wait_ready(port)
        yield f"http://127.0.0.1:{port}/mcp", proc.pid


@contextmanager
def nginx(upstream_port: int) -> Iterator[tuple[str, int] | None]:
    """nginx as a plain reverse proxy (one process, kept-alive upstream connections), when it is installed."""
    binary = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if binary is None:
        yield None
        return
    port = free_port()
    home = WORK / f"nginx-{port}"
    (home / "logs").mkdir(parents=True)
    (home / "nginx.conf").write_text(f"""
daemon off; master_process off; worker_processes 1; error_log stderr error; pid {home}/nginx.pid;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  client_body_temp_path {home}/body; proxy_temp_path {home}/proxy;
  fastcgi_temp_path {home}/fcgi; uwsgi_temp_path {home}/uwsgi; scgi_temp_path {home}/scgi;
  upstream mcp {{ server 127.0.0.1:{upstream_port}; keepalive 64; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{ proxy_pass http://mcp; proxy_http_version 1.1; proxy_set_header Connection ""; }}
  }}
}}
""")
    with process(binary, "-p", str(home), "-c", str(home / "nginx.conf"), port=port) as proc:
        yield f"http://127.0.0.1:{port}/mcp", proc.pid


def summary(runs: list[float], digits: int = 0) -> str:
    return f"{statistics.median(runs):.{digits}f} ({min(runs):.{digits}f}-{max(runs):.{digits}f})"


def proxies_by_store(
    a_install: Install, b_install: Install, upstream: str | list[str], ttl_ms: int = 60_000
) -> Iterator[tuple[str, dict[str, tuple[str, int]]]]:
    """A's and B's proxy in front of `upstream` with the memory store, then both with one redis-server of the run's;
    tasks kept `ttl_ms` (creation makes 1,000 a second: a minute of them)."""
    with ExitStack() as stack:
        redis_port = free_port()
        stack.enter_context(process("redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                                    "--appendonly", "no", port=redis_port))  # fmt: skip
        stores = {
            "memory": {"backend": "memory"},
            "redis": {"backend": "redis", "url": f"redis://127.0.0.1:{redis_port}/0"},
        }
        for name, store in stores.items():
            with (
                proxy(*a_install, upstream, "modern", store, ttl_ms) as a,
                proxy(*b_install, upstream, "modern", store, ttl_ms) as b,
            ):
                yield name, {"A": a, "B": b}


def print_table(header: list[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def tasks_created(url: str) -> float:
    """The tasks the proxy at `url` (its /mcp) has made, from its /metrics."""
    with urllib.request.urlopen(url.removesuffix("/mcp") + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text)
               if family.name == "mcp_tasks_proxy_tasks_created" for sample in family.samples
               if sample.name.endswith("_total"))  # fmt: skip


def creation(a_install: Install, b_install: Install, upstream: str, seconds: int, repeats: int, arrivals: str) -> None:
    """Task creation at 1,000/s through A and B, with the memory store and with Redis: CPU µs and p99 ms; beside
    them, the fast upstream answering a tools/call itself at the same rate (an aiohttp server doing nothing else).
    `arrivals`: the load generator, h2load (Poisson) or wrk."""
    header = ["store", "A µs/creation", "B µs/creation", "B/A", "A p99 ms", "B p99 ms", "aiohttp alone p99 ms"]
    rows = []
    load, connections = RATE_LOADS[arrivals]
    floor = [load(upstream, "tools/call", {"name": "plain", "arguments": {}}, meta=META, connections=connections,
                  seconds=seconds, name="plain", rate=1000)[2] for _ in range(repeats)]  # fmt: skip
    for name, targets in proxies_by_store(a_install, b_install, upstream):
        cpu: dict[str, list[float]] = {target: [] for target in targets}
        p99: dict[str, list[float]] = {target: [] for target in targets}
        for repeat in range(repeats):
            for target in ("A", "B") if repeat % 2 == 0 else ("B", "A"):
                url, pid = targets[target]
                made, before = tasks_created(url), cpu_s(pid)
                served, _, tail = load(url, "tools/call", {"name": "echo", "arguments": {}}, meta=META_TASKS,
                                       connections=connections, seconds=seconds, name="echo", rate=1000)  # fmt: skip
                cpu[target].append((cpu_s(pid) - before) / (served * seconds) * 1e6)
                made = tasks_created(url) - made
                if made < served * seconds * 0.99:  # the rest were JSON-RPC errors, which came on HTTP 200
                    raise SystemExit(f"{target} ({url}) made {made:.0f} tasks of {served * seconds:.0f} calls answered")
                p99[target].append(tail)
        ratio = statistics.median(cpu["B"]) / statistics.median(cpu["A"])
        rows.append([name, summary(cpu["A"]), summary(cpu["B"]), f"{ratio:.3f}", summary(p99["A"], 2),
                     summary(p99["B"], 2), summary(floor, 2)])  # fmt: skip
        print(f"  create, {name} store: B/A {ratio:.3f}", file=sys.stderr)
    print_table(header, rows)


def reads(
    a_install: Install,
    b_install: Install,
    upstream: str | list[str],
    seconds: int,
    repeats: int,
    connections: list[int],
    method: str = "tasks/get",
) -> None:
    """tasks/get of a finished task through A and B, closed loop, with the memory store and with Redis; or
    `method` (server/discover, or tools/call: the pass-through to a stdio `upstream`), with the memory store."""
    short = method.rsplit("/", 1)[1]
    header = ["store", "c", f"A µs/{short}", f"B µs/{short}", "B/A", "A req/s", "B req/s"]
    rows = []
    # A task a day: it must outlive the longest run that polls it (one made before each wrk run).
    for name, targets in proxies_by_store(a_install, b_install, upstream, ttl_ms=86_400_000):
        if method != "tasks/get" and name != "memory":
            break
        for count in connections:
            cpu: dict[str, list[float]] = {target: [] for target in targets}
            rate: dict[str, list[float]] = {target: [] for target in targets}
            for repeat in range(repeats):
                for target in ("A", "B") if repeat % 2 == 0 else ("B", "A"):
                    url, pid = targets[target]
                    if method == "tasks/get":
                        task_id = finished_task(url)  # a new one each time, as in a run of its own
                        total, spent = wrk_total(url, pid, count, seconds, task_id)
                    elif method == "tools/call":
                        total, spent = wrk_total(url, pid, count, seconds)
                    else:
                        total, spent = wrk_total(url, pid, count, seconds, meta=META_TASKS, method=method)
                    cpu[target].append(spent / total * 1e6)
                    rate[target].append(total / seconds)
            ratio = statistics.median(cpu["B"]) / statistics.median(cpu["A"])
            rows.append([name, str(count), summary(cpu["A"]), summary(cpu["B"]), f"{ratio:.3f}",
                         summary(rate["A"]), summary(rate["B"])])  # fmt: skip
            print(f"  {method}, {name} store, c={count}: B/A {ratio:.3f}", file=sys.stderr)
    print_table(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD", help="the commit to compare the work tree with (default: HEAD)")
    parser.add_argument("--connections", default="1,16,64", help="comma-separated wrk connection counts")
    parser.add_argument("--eras", default="modern,legacy", help="the upstream's era: modern, legacy or both")
    parser.add_argument("--seconds", type=int, default=4, help="length of each wrk run")
    parser.add_argument("--repeats", type=int, default=7, help="runs of each target per concurrency")
    parser.add_argument("--quick", action="store_true", help="2 s runs, 3 repeats")
    parser.add_argument("--client", choices=("plain", "tasks"), default="plain",
                        help="pass-through: a client that declares nothing, or the tasks extension")  # fmt: skip
    parser.add_argument("--log-level", choices=("warning", "info"), default="warning",
                        help="the proxies' logging.level on the pass-through path: warning writes no line a request "
                             "(the figures of docs/benchmarks.md), info one (the default of a deployment)")  # fmt: skip
    parser.add_argument("--path", choices=("passthrough", "create", "get", "discover", "stdio"), default="passthrough",
                        help="what is measured: a pass-through tools/call, task creation at 1,000/s, "
                             "tasks/get of a finished task, server/discover, or a pass-through tools/call to a "
                             "stdio child")  # fmt: skip
    variants = ("tracing", "tracing-ratio", "advertise", "jwt", "rates", "rates-memory", "concurrency",
                "concurrency-memory")  # fmt: skip
    parser.add_argument("--variant", choices=variants, default=None,
                        help="pass-through: the work tree plain (A) against itself so configured (B): tracing, "
                             "listen.advertise_url, verified tokens, a rate limit in Redis or in memory; instead "
                             "of --base against the work tree")  # fmt: skip
    parser.add_argument("--arrivals", choices=("h2load", "wrk"), default="h2load",
                        help="--path create: Poisson arrivals from h2load (one process per connection), or wrk's "
                             "delay(), which bunches them on millisecond ticks")  # fmt: skip
    args = parser.parse_args()
    seconds, repeats = (2, 3) if args.quick else (args.seconds, args.repeats)
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is needed: apt-get install wrk")
    if args.path == "create" and args.arrivals == "h2load" and shutil.which("h2load") is None:
        raise SystemExit("h2load is needed for Poisson arrivals: apt-get install nghttp2-client (or --arrivals wrk)")
    if args.path in ("create", "get") and shutil.which("redis-server") is None:
        raise SystemExit(f"redis-server is needed for --path {args.path}: apt-get install redis-server")
    if args.variant is not None and (args.path != "passthrough" or shutil.which("redis-server") is None):
        raise SystemExit("--variant measures the pass-through path, on a Redis store: apt-get install redis-server")
    b_install = worktree_python()
    a_install = base_python(args.base) if args.variant is None else b_install
    if args.variant == "jwt":  # both proxies get the token (A forwards it unread), B verifies it
        HEADERS["Authorization"] = f"Bearer {bench_token()}"
    if args.variant in ("tracing", "tracing-ratio"):  # the otel extra, in the work tree's environment
        subprocess.run([str(b_install[0]), "-m", "pip", "install", "--quiet", "opentelemetry-sdk",
                        "opentelemetry-exporter-otlp-proto-http"], check=True)  # fmt: skip
    # A comparison of a tree with itself reads as "no change": make sure A and B are the trees they claim to be.
    a_tree, b_tree = imported_from(*a_install), imported_from(*b_install)
    a_cached = args.variant is not None or a_tree.is_relative_to(CACHE.resolve())
    if not a_cached or not same_sources(b_tree, ROOT / "proxy"):
        raise SystemExit(f"A imports the proxy from {a_tree} and B from {b_tree}: not the two trees to compare")
    a_versions, b_versions = dependency_versions(a_install[0]), dependency_versions(b_install[0])
    differ = [f"{name} {a_versions[name]} (A) / {b_versions[name]} (B)" for name in a_versions
              if a_versions[name] != b_versions[name]]  # fmt: skip
    if differ:  # the base's environment was made on another day: say so, as it weighs on B/A
        print(f"# note: the installs differ in {', '.join(differ)}; `rm -rf bench/.ab` makes both afresh")
    head = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True, text=True)
    load = "h2load (Poisson arrivals)" if args.path == "create" and args.arrivals == "h2load" else "wrk -t1"
    declares = " · the client declares tasks" if args.client == "tasks" and args.path == "passthrough" else ""
    declares += " · a log line a request (logging.level info)" if args.log_level == "info" else ""
    compared = (f"{args.base} (A) against the work tree {head.stdout.strip()} (B)" if args.variant is None else
                f"the work tree {head.stdout.strip()} plain (A) against itself with {args.variant} (B)")  # fmt: skip
    print(f"# A/B: {compared} · {os.cpu_count()} cores · "
          f"{load}, {seconds} s runs, {repeats} repeats, interleaved · CPU µs/request, median (min-max)"
          f"{declares}")  # fmt: skip
    upstream_port = free_port()
    upstream = f"http://127.0.0.1:{upstream_port}/mcp"
    with ExitStack() as stack:
        stack.enter_context(process(sys.executable, str(HERE / "fast_upstream.py"), str(upstream_port),
                                    port=upstream_port))  # fmt: skip
        if args.path == "create":
            creation(a_install, b_install, upstream, seconds, repeats, args.arrivals)
            return
        if args.path in ("get", "discover"):
            method = "tasks/get" if args.path == "get" else "server/discover"
            connections = [int(c) for c in args.connections.split(",")]
            reads(a_install, b_install, upstream, seconds, repeats, connections, method)
            return
        if args.path == "stdio":
            connections = [int(c) for c in args.connections.split(",")]
            child = [sys.executable, str(HERE / "fast_stdio.py")]
            reads(a_install, b_install, child, seconds, repeats, connections, "tools/call")
            return
        forwarder_port = free_port()
        forwarder = stack.enter_context(process(sys.executable, str(HERE / "minimal_forwarder.py"),
                                                str(forwarder_port), upstream, port=forwarder_port))  # fmt: skip
        fixed = {"forwarder": (f"http://127.0.0.1:{forwarder_port}/mcp", forwarder.pid)}
        web = stack.enter_context(nginx(upstream_port))
        if web is not None:
            fixed["nginx"] = web
        rows = []
        meta = META_TASKS if args.client == "tasks" else META
        redis_url = None
        if args.variant is not None:
            redis_port = free_port()
            stack.enter_context(process("redis-server", "--port", str(redis_port), "--save", "", "--appendonly", "no",
                                        port=redis_port))  # fmt: skip
            redis_url = f"redis://127.0.0.1:{redis_port}/0"
        plain = "plain" if args.variant is not None else None
        for era in args.eras.split(","):
            with (
                proxy(*a_install, upstream, era, log_level=args.log_level, variant=plain, redis_url=redis_url) as a,
                proxy(*b_install, upstream, era, log_level=args.log_level, variant=args.variant,
                      redis_url=redis_url) as b,
            ):  # fmt: skip
                targets = {"A": a, "B": b, **fixed}
                for connections in (int(c) for c in args.connections.split(",")):
                    cpu: dict[str, list[float]] = {name: [] for name in targets}
                    rate: dict[str, list[float]] = {name: [] for name in targets}
                    names = list(targets)
                    for repeat in range(repeats):
                        turn = repeat % len(names)
                        for name in names[turn:] + names[:turn]:  # each target first in turn
                            url, pid = targets[name]
                            total, spent = wrk_total(url, pid, connections, seconds, meta=meta)
                            cpu[name].append(spent / total * 1e6)
                            rate[name].append(total / seconds)
                    median = {name: statistics.median(values) for name, values in cpu.items()}
                    rows.append([era, str(connections)] + [summary(cpu[name]) for name in names] + [
                        f"{median['B'] / median['A']:.3f}", f"{median['B'] / median['forwarder']:.2f}",
                        f"{statistics.median(rate['B']) / statistics.median(rate['nginx']):.2f}" if "nginx" in rate
                        else "-",
                    ])  # fmt: skip
                    print(f"  {era} c={connections}: B/A {median['B'] / median['A']:.3f}", file=sys.stderr)
        header = ["upstream", "c", *(f"{name} µs/req" for name in ("A", "B", *fixed)), "B/A", "B/forwarder",
                  "B/nginx req/s"]  # fmt: skip
        print_table(header, rows)


if __name__ == "__main__":
    main()
