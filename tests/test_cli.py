"""The installed command, run as a user would: a real process, real ports, logs on stderr, SIGTERM to stop."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import pytest
from aiohttp import web

from tests.conftest import PROXY, ROOT, eventually, free_port, stop, task_reaches, wait_for_port
from tests.factories import McpClient


def json_log(path) -> tuple[list[dict], list[str]]:
    """The JSON lines of a proxy's log file, and their events in order."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
    return lines, [line["event"] for line in lines]


def test_console_script_is_installed():
    path = shutil.which("mcp-tasks-proxy") or os.path.join(os.path.dirname(sys.executable), "mcp-tasks-proxy")
    done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    assert done.stdout.startswith("mcp-tasks-proxy ")


async def test_runs_from_environment_alone_and_serves_a_task(mcp_upstream, tmp_path):
    port = free_port()
    policy = tmp_path / "policy.yaml"
    policy.write_text("tools:\n  - match: slow_report\n    task: required\n")
    env = {
        **os.environ,
        "MCP_TASKS_PROXY_CONFIG": str(policy),
        "MCP_TASKS_PROXY_UPSTREAM": mcp_upstream,
        "MCP_TASKS_PROXY_PORT": str(port),
        "MCP_TASKS_PROXY_LOG_FORMAT": "json",
    }
    log_path = tmp_path / "proxy.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen([*PROXY], env=env, stderr=log_file, cwd=ROOT)
        try:
            wait_for_port(port, process)
            async with aiohttp.ClientSession() as session:
                client = McpClient(session, f"http://127.0.0.1:{port}/mcp")
                created = await client.call_tool("slow_report", {"topic": "zebra-topic-7", "seconds": 0})
                assert created.result["resultType"] == "task"
                await task_reaches(client, created.result["taskId"], "completed")
                async with session.get(f"http://127.0.0.1:{port}/healthz") as response:
                    assert response.status == 200
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=30) == 0
        finally:
            stop(process)
    lines, events = json_log(log_path)
    started = lines[events.index("proxy_started")]
    assert started["listen"] == f"http://127.0.0.1:{port}/mcp"
    assert started["upstream"] == mcp_upstream and started["rules"] == 1 and started["store"] == "memory"
    transitions = [line for line in lines if line["event"] == "task_transition"]
    assert [t["to"] for t in transitions] == ["working", "completed"]
    assert all(t["task_id"] == created.result["taskId"] and t["tool"] == "slow_report" for t in transitions)
    handled = [line for line in lines if line["event"] == "request_handled"]
    assert {"method", "status", "duration_ms", "request_id", "mode"} <= handled[0].keys()
    # Tool arguments and results never reach the log by default.
    assert "zebra-topic-7" not in log_path.read_text()
    assert "listen_loopback_only" not in events  # no defaults file asked for another address


def test_a_policy_that_narrows_the_images_listen_address_to_loopback_is_warned_about(mcp_upstream, tmp_path):
    """In a container, the image's defaults file listens on 0.0.0.0; a mounted policy's listen.host: 127.0.0.1 wins,
    and nothing outside the container can connect (while the HEALTHCHECK, from inside, says healthy): one warning."""
    port = free_port()
    defaults = tmp_path / "defaults.yaml"
    defaults.write_text("listen:\n  host: 0.0.0.0\n  port: 8080\n")
    policy = tmp_path / "policy.yaml"
    policy.write_text(f"listen:\n  host: 127.0.0.1\n  port: {port}\n")
    env = {"MCP_TASKS_PROXY_DEFAULTS": str(defaults), "MCP_TASKS_PROXY_CONFIG": str(policy),
           "MCP_TASKS_PROXY_UPSTREAM": mcp_upstream, "MCP_TASKS_PROXY_LOG_FORMAT": "json"}  # fmt: skip
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MCP_TASKS_PROXY_")}
    log_path = tmp_path / "proxy.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen([*PROXY], env=clean | env, stderr=log_file, cwd=ROOT)
        try:
            wait_for_port(port, process)
            deadline = time.monotonic() + 30  # logged once serving: the port may open a moment before
            while "proxy_started" not in log_path.read_text() and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            stop(process)
    lines, events = json_log(log_path)
    assert events.count("listen_loopback_only") == 1
    warning = lines[events.index("listen_loopback_only")]
    assert warning["level"] == "warning"
    assert warning["listen"] == f"127.0.0.1:{port}" and warning["defaults_host"] == "0.0.0.0"
    assert warning["defaults"] == str(defaults)


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MCP_TASKS_PROXY_")}
    return subprocess.run([*PROXY, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**clean, **(env or {})})  # fmt: skip


def test_help_names_the_commands_and_the_precedence():
    done = run_cli("--help")
    assert done.returncode == 0
    assert "check [FILE] [TOOL ...]" in done.stdout and "health" in done.stdout
    assert "embedded defaults < --defaults file < --config file < environment < flags" in done.stdout


def test_health_help_is_health_s_own():
    done = run_cli("health", "--help")
    assert done.returncode == 0
    assert done.stdout.startswith("usage: mcp-tasks-proxy health [options]")
    assert "/healthz" in done.stdout and "check [FILE]" not in done.stdout


def test_check_needs_no_file_and_fails_when_the_upstream_cannot_be_asked(mcp_upstream):
    bare = run_cli("check")
    assert bare.returncode == 0, bare.stderr
    assert bare.stdout.splitlines()[0] == "the embedded defaults: valid, 0 rule(s)"
    assert "give --upstream URL, or name the tools" in bare.stdout
    asked = run_cli("check", "--upstream", mcp_upstream)  # no file: the embedded defaults, this upstream
    assert asked.returncode == 0, asked.stderr
    assert any(line.split()[:3] == ["slow_report", "(none)", "passthrough"] for line in asked.stdout.splitlines())
    named = run_cli("check", "slow_report", env={"MCP_TASKS_PROXY_CONFIG": "config/example.yaml"})
    assert named.returncode == 0 and named.stdout.splitlines()[0] == "config/example.yaml: valid, 3 rule(s)"
    unreachable = run_cli("check", "config/example.yaml", "--upstream", f"http://127.0.0.1:{free_port()}/mcp")
    assert unreachable.returncode == 1
    assert "could not be asked for its tools" in unreachable.stderr and "Traceback" not in unreachable.stderr


async def test_check_says_what_an_upstream_that_is_not_mcp_answered(fake_upstream):
    """A wrong path answers 404: `check` says so (it said "could not be asked ...; start it")."""

    async def not_found(request: web.Request) -> web.Response:
        return web.Response(status=404, text="Not Found")

    fake = await fake_upstream(not_found)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MCP_TASKS_PROXY_")}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "mcp_tasks_proxy", "check", "--upstream", fake.url,
        cwd=ROOT, env=clean, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, stderr = await process.communicate()  # async: this loop serves the fake upstream meanwhile
    assert process.returncode == 1
    said = stderr.decode()
    assert (
        f"{fake.url}: the upstream answered neither MCP era: server/discover got HTTP 404, initialize got HTTP 404"
        in said
    )
    assert "(is upstream.url's path right?)" in said and "start it" not in said and "Traceback" not in said


def test_check_warns_of_each_rule_that_matches_no_tool_and_strict_makes_it_fail(mcp_upstream, tmp_path):
    """A typo in match: let the slow tool pass through untasked, and `check` said the policy was fine."""
    typo = tmp_path / "typo.yaml"
    typo.write_text("tools:\n  - match: slow_reprot\n  - match: gated\n  - match: 'slwo_*'\n")
    warned = run_cli("check", str(typo), "--upstream", mcp_upstream)
    assert warned.returncode == 0, warned.stderr
    assert warned.stderr.splitlines() == [
        "mcp-tasks-proxy check: warning: the rule 'slow_reprot' matches no tool of the upstream "
        "(did you mean 'slow_report'?)",
        "mcp-tasks-proxy check: warning: the rule 'slwo_*' matches no tool of the upstream (did you mean 'slow_*'?)",
    ]
    assert any(line.split()[:3] == ["gated", "gated", "optional"] for line in warned.stdout.splitlines())
    strict = run_cli("check", str(typo), "--upstream", mcp_upstream, "--strict")
    assert strict.returncode == 1 and strict.stderr == warned.stderr
    fine = run_cli("check", "config/example.yaml", "--upstream", mcp_upstream, "--strict")
    assert fine.returncode == 0 and fine.stderr == "", fine.stderr  # every rule of the quick start matches a tool


async def test_the_proxy_names_rules_that_match_no_tool_once_the_upstream_first_answers(tmp_path):
    """Start-up does not wait for the upstream: the proxy serves (not ready) while it is down, and the rules are
    checked when it first answers; one warning per rule that matches none of its tools."""
    port, upstream_port = free_port(), free_port()
    policy = tmp_path / "policy.yaml"
    policy.write_text(f"listen:\n  port: {port}\ntools:\n  - match: slow_reprot\n  - match: gated\n")
    env = {"MCP_TASKS_PROXY_CONFIG": str(policy), "MCP_TASKS_PROXY_LOG_FORMAT": "json",
           "MCP_TASKS_PROXY_UPSTREAM": f"http://127.0.0.1:{upstream_port}/mcp"}  # fmt: skip
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MCP_TASKS_PROXY_")}
    log_path = tmp_path / "proxy.log"
    upstream = None
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen([*PROXY], env=clean | env, stderr=log_file, cwd=ROOT)
        try:
            wait_for_port(port, process)
            async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/readyz") as response:
                assert response.status == 503  # serving, the upstream not there yet
            assert "rule_matches_no_tool" not in json_log(log_path)[1]
            upstream = subprocess.Popen(
                [sys.executable, str(ROOT / "tests" / "upstream_server.py"), str(upstream_port)]
            )
            wait_for_port(upstream_port, upstream)

            async def warned():
                return "rule_matches_no_tool" in json_log(log_path)[1]

            await eventually(warned, what="the rules checked once the upstream answered")
        finally:
            stop(process)
            if upstream is not None:
                stop(upstream)
    lines, events = json_log(log_path)
    warnings = [line for line in lines if line["event"] == "rule_matches_no_tool"]
    assert len(warnings) == 1
    assert warnings[0]["level"] == "warning" and warnings[0]["pattern"] == "slow_reprot"
    assert warnings[0]["suggestion"] == "slow_report" and warnings[0]["tools"] > 1
    assert events.index("proxy_started") < events.index("rule_matches_no_tool")


def test_start_up_failures_are_one_line_and_exit_2(tmp_path, mcp_upstream):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        in_use = run_cli("--upstream", mcp_upstream, "--port", str(port))
    assert in_use.returncode == 2
    expected = f"mcp-tasks-proxy: cannot listen on 127.0.0.1:{port}: Address already in use"
    assert in_use.stderr.strip().splitlines() == [expected]
    assert "proxy_started" not in in_use.stdout + in_use.stderr  # bound before announcing
    bad = tmp_path / "bad.yaml"
    bad.write_text("listen:\n  port: abc\nfoo: 1\n")
    refused = run_cli("--config", str(bad), "--upstream", mcp_upstream)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "2 errors: foo: unknown key; listen.port:" in refused.stderr
    no_upstream = run_cli()
    assert no_upstream.returncode == 2 and "no upstream: set upstream.url" in no_upstream.stderr
    missing = run_cli("--upstream", mcp_upstream, "--", str(tmp_path / "no-such-server"))
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1, missing.stderr


@pytest.mark.parametrize(("flags", "env", "line"), [
    (["--store", "redis//127.0.0.1:6379"], {},
     "mcp-tasks-proxy: config error: --store 'redis//127.0.0.1:6379': store.url must start with redis://"),
    ([], {"MCP_TASKS_PROXY_STORE": "redis://ops:s3cret@db:notaport/0"},
     "mcp-tasks-proxy: config error: MCP_TASKS_PROXY_STORE 'redis://ops:***@db:notaport/0': Port could not be cast"),
    (["--advertise-url", "nope"], {}, "mcp-tasks-proxy: config error: --advertise-url 'nope': Input should be a "),
])  # fmt: skip
def test_a_refused_flag_or_variable_is_named_as_given(flags, env, line):
    """Not the config path it becomes (`overrides: store: ...`); a password in a URL is not repeated."""
    done = run_cli("--upstream", "http://127.0.0.1:9/mcp", *flags, env=env)
    assert done.returncode == 2
    (said,) = done.stderr.strip().splitlines()
    assert said.startswith(line), said
    assert "s3cret" not in said


async def test_start_and_stop_are_logged_and_health_finds_the_port(mcp_upstream, tmp_path):
    port = free_port()
    policy = tmp_path / "policy.yaml"
    policy.write_text(f"listen:\n  port: {port}\ntasks:\n  shutdown_grace_s: 1\ntools:\n  - match: gated\n")
    env = {**os.environ, "MCP_TASKS_PROXY_CONFIG": str(policy), "MCP_TASKS_PROXY_LOG_FORMAT": "json"}
    env.pop("MCP_TASKS_PROXY_PORT", None)
    log_path = tmp_path / "proxy.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen([*PROXY, "--upstream", mcp_upstream], env=env,
                                   stderr=log_file, cwd=ROOT)  # fmt: skip
        try:
            wait_for_port(port, process)
            health = subprocess.run([*PROXY, "health"], env=env, timeout=60)
            assert health.returncode == 0  # the policy's port, found from the same configuration
            async with aiohttp.ClientSession() as session:
                client = McpClient(session, f"http://127.0.0.1:{port}/mcp")
                created = await client.call_tool("gated", {"tag": secrets.token_hex(4)})  # never released
                await task_reaches(client, created.result["taskId"], "working")
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=30) == 0
        finally:
            stop(process)
    lines, events = json_log(log_path)
    started = lines[events.index("proxy_started")]
    assert started["policy"] == str(policy) and started["upstream"] == mcp_upstream and started["store"] == "memory"
    stopping = events.index("proxy_stopping")
    assert "open_connections" in lines[stopping]
    draining = lines[events.index("tasks_draining")]
    assert draining["running"] == 1 and draining["grace_s"] == 1
    drained = lines[events.index("tasks_drained")]
    assert drained["failed_at_shutdown"] == 1
    assert stopping < events.index("tasks_draining") < events.index("tasks_drained") < events.index("proxy_stopped")
    assert subprocess.run([*PROXY, "health"], env=env, timeout=60).returncode == 1


def test_a_stop_signal_between_bind_and_serve_is_remembered_not_fatal():
    """The socket takes connections from bind() on, before the loop's signal handlers exist: a SIGTERM in that
    window (an orchestrator, a test that saw the port open) killed the process instead of stopping it gracefully."""
    code = (
        "import os, signal\n"
        "from mcp_tasks_proxy.front import serve\n"
        "serve.hold_stop_signals()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "print(serve._stop_requested)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, "True"), done.stderr
