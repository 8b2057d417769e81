"""The quick start as a newcomer runs it: the demo starts the example server and the proxy, and walks a task."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT, free_port


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
