"""A stdio child that leaves a process behind that holds its pipes.

A child that leaves a grandchild in a session of its own holding its pipes is restarted with its old pipes closed:
the proxy's open descriptors do not grow with restarts. tests/stdio_hostile.py injects the faults.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path

import pytest
import uvloop

from proxy.upstream import stdio_process
from proxy.upstream.stdio_process import ChildSpec, Supervisor
from tests.conftest import ROOT, eventually

# --- a grandchild that holds the pipes ----------------------------------------------------------------------------


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def _restarts(pid_file: Path, runs: int) -> tuple[list[int], list[int]]:
    """Run a child that leaves a grandchild holding its pipes and exits, until it has started `runs` times: the
    number of the process's open descriptors as each run started, and the exit statuses seen."""
    fds: list[int] = []
    statuses: list[int] = []
    spec = ChildSpec(
        argv=[sys.executable, str(ROOT / "tests" / "stdio_hostile.py"), "leaves_a_grandchild", str(pid_file)],
        env=dict(os.environ),
        restart_min_s=0.01,
        restart_max_s=0.01,
    )
    supervisor = Supervisor(
        spec,
        on_start=lambda child: fds.append(open_fds()),
        on_exit=lambda child, status: statuses.append(status),
        on_message=lambda child, message, size: None,
        on_oversized=lambda child, line: None,
    )
    await supervisor.start()

    async def started_enough() -> bool:
        return len(fds) >= runs

    try:
        await eventually(started_enough, what=f"{runs} runs of the child")
    finally:
        await supervisor.stop()
    return fds, statuses


@pytest.mark.parametrize("loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
def test_restarts_close_the_pipes_a_detached_grandchild_holds(loop_factory, tmp_path, monkeypatch):
    monkeypatch.setattr(stdio_process, "_LAST_OUTPUT_S", 0.2)  # the grandchild never closes them: no end of file
    pid_file = tmp_path / "grandchildren"
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            fds, statuses = runner.run(_restarts(pid_file, runs=6))
    finally:
        for pid in pid_file.read_text().split() if pid_file.exists() else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    assert len(pid_file.read_text().split()) >= 5  # each run left one behind, holding its pipes
    assert set(statuses) == {1}, statuses  # every exit was seen (its calls failed), though the pipes stayed open
    assert fds[1:] == [fds[0]] * (len(fds) - 1), fds  # a run's pipes are closed before the next one starts
