"""The examples as a newcomer runs them: the quick start's demo, and the example client's command line."""

from __future__ import annotations

import importlib.util
import json
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT, free_port, quick_start, start_redis, stop

CLIENT = ROOT / "examples" / "task_client.py"


@pytest.fixture(autouse=True)
def own_temp_dir(tmp_path, monkeypatch):
    """The demo writes its log to the temporary directory: the test's own, not the machine's /tmp."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))


@pytest.mark.parametrize("transport", ["http", "stdio"])
def test_demo_walks_the_task_flow_and_exits_cleanly(transport):
    done = subprocess.run(
        [
            sys.executable,
            "examples/demo.py",
            "--exit",
            *(["--stdio"] if transport == "stdio" else []),
            "--server-port",
            str(free_port()),
            "--proxy-port",
            str(free_port()),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert '"resultType": "task"' in out
    assert "status='completed'" in out
    assert '"status": "cancelled"' in out
    assert "status='input_required'" in out and '"method": "tasks/update"' in out
    assert "Dear Ada, here is your report on tides." in out
    assert "<-- notifications/tasks: status='completed'" in out
    assert "Done: three tasks completed" in out
    # The walk-through alone: the log lines went to the file it names, not between its lines.
    named = re.search(r"The server's and the proxy's logs: (\S+);", out)
    assert named, out[:500]
    assert '"event"' not in out and '"event"' not in done.stderr, done.stderr[-2000:]
    assert '"event":"task_transition"' in Path(named.group(1)).read_text()


@pytest.mark.parametrize("option", ["--server-port", "--proxy-port"])
def test_demo_refuses_a_port_another_program_holds(option):
    """It used to walk its flow against whatever listened there, and end in a traceback."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        other = "--proxy-port" if option == "--server-port" else "--server-port"
        done = subprocess.run([sys.executable, "examples/demo.py", "--exit", option, str(taken), other,
                               str(free_port())], cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.strip() == f"demo: port {taken} is taken by another program: pass {option} with a free port"


def test_the_demo_runs_again_at_once_on_the_same_ports():
    """Its ports are in TIME-WAIT right after a run; the port probe said "taken by another program"."""
    ports = ["--server-port", str(free_port()), "--proxy-port", str(free_port())]
    for _ in range(2):
        done = subprocess.run([sys.executable, "examples/demo.py", "--exit", *ports], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]


def test_a_demo_stopped_with_sigterm_stops_its_server_and_proxy():
    server_port, proxy_port = free_port(), free_port()
    demo = subprocess.Popen([sys.executable, "examples/demo.py", "--server-port", str(server_port), "--proxy-port",
                             str(proxy_port)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)  # fmt: skip
    try:
        assert demo.stdout is not None
        for line in demo.stdout:  # the walk-through, then it keeps both running
            if "Ctrl-C stops both" in line:
                break
        demo.terminate()
        assert demo.wait(timeout=30) == 128 + 15
        for port in (server_port, proxy_port):
            with socket.socket() as probe:
                assert probe.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still served"
    finally:
        stop(demo)
        if demo.stdout is not None:
            demo.stdout.close()


def client(*args: str, timeout: float = 50) -> subprocess.CompletedProcess[str]:
    """The example client as a user runs it, without a terminal on stdin (so it never prompts)."""
    return subprocess.run(
        [sys.executable, str(CLIENT), *args],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    return lines[0]


@pytest.fixture(scope="module")
def proxy_url() -> Iterator[str]:
    with quick_start() as url:
        yield url


def test_client_help_exits_0_with_its_usage():
    done = client("--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: task_client.py [options] URL [TOOL [JSON_ARGUMENTS]]")
    for option in ("--answer JSON|TEXT", "--poll-interval SECONDS", "--timeout SECONDS", "--verbose"):
        assert option in done.stdout
    assert done.stderr == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["http://127.0.0.1:8080/mcp", "slow_report", '{"topic": '], "JSON_ARGUMENTS is not valid JSON"),
        (["http://127.0.0.1:8080/mcp", "slow_report", '["tides"]'], "JSON_ARGUMENTS must be a JSON object"),
        (["127.0.0.1:8080/mcp", "slow_report"], "URL must be an http:// or https:// URL"),
        (["ftp://127.0.0.1/mcp", "slow_report"], "URL must be an http:// or https:// URL"),
        (["http://127.0.0.1:80x/mcp", "slow_report"], "URL must be an http:// or https:// URL"),
        (["http://127.0.0.1:8080/mcp", "add", "{}", "--timeout", "0"], "--timeout must be a positive number"),
        (["http://127.0.0.1:8080/mcp", "add", "{}", "--poll-interval", "soon"], "--poll-interval: invalid float"),
        ([], "the following arguments are required: URL"),
    ],
)
def test_client_usage_errors_exit_2_with_one_line(args, message):
    done = client(*args)
    assert done.returncode == 2, (done.stdout, done.stderr)
    line = one_line_error(done)
    assert line.startswith("task_client.py: error: ") and message in line, line
    assert done.stdout == ""


def test_client_names_the_url_it_cannot_connect_to():
    url = f"http://127.0.0.1:{free_port()}/mcp"  # nothing listens there
    done = client(url, "slow_report", '{"topic": "tides"}')
    assert done.returncode == 1
    assert one_line_error(done) == f"error: cannot connect to {url}: connection refused (is the proxy running?)"


def test_client_runs_a_tool_as_a_task_to_its_result(proxy_url):
    done = client(proxy_url, "slow_report", '{"topic": "tides", "seconds": 2}', "--poll-interval", "0.2")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert f"{proxy_url}: slow-example, io.modelcontextprotocol/tasks offered" in out
    created = json.loads(re.search(r"^<-- CreateTaskResult (\{.*\})$", out, re.MULTILINE).group(1))
    assert created["resultType"] == "task" and created["status"] == "working"
    assert "tasks/get: status='working' statusMessage='researching tides: step" in out
    assert "tasks/get: status='completed'" in out
    final = json.loads(re.search(r"^<-- (\{\"taskId\".*\})$", out, re.MULTILINE).group(1))
    assert final["taskId"] == created["taskId"] and final["status"] == "completed"
    assert out.rstrip().endswith("Report on tides: all 5 steps done in 2 s.")
    assert done.stderr == ""


@pytest.mark.parametrize("answer", ['{"name": "Ada"}', "Ada"])  # plain text answers a form of one field
def test_client_answers_the_task_question_with_answer(proxy_url, answer):
    args = (proxy_url, "personal_report", '{"topic": "tides", "seconds": 1}', "--answer", answer)
    done = client(*args, "--poll-interval", "0.2")
    assert done.returncode == 0, done.stderr
    assert "tasks/get: status='input_required'" in done.stdout
    assert "elicitation/create 'Who is this report for?'" in done.stdout
    assert "tasks/update: answered" in done.stdout
    assert done.stdout.rstrip().endswith("Dear Ada, here is your report on tides.")


def test_client_without_answers_declares_no_elicitation_and_says_why_the_task_failed(proxy_url):
    done = client(proxy_url, "personal_report", '{"topic": "tides"}', "--poll-interval", "0.2")
    assert done.returncode == 1
    line = one_line_error(done)
    assert line.startswith("error: task ") and " failed: -32021 " in line, line
    assert "give --answer, or run on a terminal" in line


def test_client_passes_a_plain_tool_through_and_reports_tool_errors(proxy_url):
    done = client(proxy_url, "add", '{"a": 2, "b": 3}')
    assert done.returncode == 0, done.stderr
    assert "CreateTaskResult" not in done.stdout and done.stdout.rstrip().endswith("\n5")
    done = client(proxy_url, "failing_job", "--poll-interval", "0.2")
    assert done.returncode == 1
    assert "<-- CreateTaskResult" in done.stdout and '"isError": true' in done.stdout
    assert one_line_error(done) == "error: the tool reported an error (isError: true)"


def test_client_timeout_cancels_the_task_it_leaves(proxy_url):
    done = client(proxy_url, "slow_report", '{"topic": "volcanoes", "seconds": 30}', "--timeout", "1")
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    task_id = re.search(r'"taskId": "([^"]+)"', done.stdout).group(1)
    assert f"error: task {task_id} did not finish within 1 s (status working)" in done.stderr
    assert f"note: task {task_id} cancelled" in done.stderr
    spec = importlib.util.spec_from_file_location("task_client", CLIENT)
    task_client = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(task_client)
    answer = task_client.rpc(
        proxy_url, "tasks/get", {"taskId": task_id, "_meta": task_client.envelope()}, name=task_id, quiet=True
    )
    assert answer["result"]["status"] == "cancelled"


@pytest.mark.parametrize("store", ["memory", "redis"])
def test_verified_callers_walks_refusals_a_token_refresh_and_a_limit_across_replicas(store):
    """The newcomer's run of docs/getting-started.md, "Accept only your issuer's tokens": one proxy, or two replicas
    on one Redis with every request after the first sent to the other one."""
    process, url = start_redis() if store == "redis" else (None, None)
    try:
        done = subprocess.run(
            [sys.executable, "examples/verified_callers.py", "--server-port", str(free_port()),
             "--proxy-port", str(free_port()), *(["--redis", url, "--second-port", str(free_port())] if url else [])],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        if process is not None:
            stop(process)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert 'HTTP 401, WWW-Authenticate: Bearer resource_metadata="http://127.0.0.1:' in out
    assert 'error="invalid_token"' in out
    assert "HTTP 429, Retry-After: 1" in out and '"limit": "one-slow-call"' in out
    assert "Task not found" in out
    assert "Report on tides: all 5 steps done in 4 s." in out
    assert len(set(re.findall(r"--> (http://\S+)", out))) == (2 if store == "redis" else 1)
