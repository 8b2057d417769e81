"""The installed command, run as a user would: a real process, real ports, logs on stderr, SIGTERM to stop."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import aiohttp

from tests.conftest import ROOT, free_port, stop, task_reaches, wait_for_port
from tests.factories import McpClient


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
        process = subprocess.Popen([sys.executable, "-m", "proxy"], env=env, stderr=log_file, cwd=ROOT)
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
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    events = [line["event"] for line in lines]
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
