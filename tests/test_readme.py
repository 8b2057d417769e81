"""The README as a user reads it: its contents links lead somewhere, CI runs the test command it shows, the first
commands make their own virtual environment (a stock Debian Python refuses pip outside one)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess

from tests.conftest import ROOT, free_port

README = (ROOT / "README.md").read_text()


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens kept), spaces become hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def sh_blocks_after(title: str) -> list[str]:
    section = README[README.index(title) :]
    return re.findall(r"```sh\n(.*?)```", section, re.S)


def test_every_link_of_the_contents_names_a_heading_or_a_file():
    headings = {slug(line.lstrip("#")) for line in README.splitlines() if line.startswith("#")}
    contents = README[README.index("## Contents") : README.index("## Which clients benefit")]
    targets = re.findall(r"\]\(([^)]+)\)", contents)
    assert len(targets) > 20
    for target in targets:
        if target.startswith("#"):
            assert target[1:] in headings, target
        else:
            assert (ROOT / target).exists(), target
    assert slug("Live policy reload, `check` and `health`") == "live-policy-reload-check-and-health"


def test_ci_runs_the_readme_test_command_verbatim_in_its_own_environment():
    command = sh_blocks_after("## Run the tests")[0].strip()
    assert command.startswith("python3 -m venv .venv && . .venv/bin/activate && ")
    ci = (ROOT / ".ci" / "run").read_text()
    assert command in ci.splitlines()
    assert "export CI=true" in ci


def test_the_quick_start_makes_its_own_environment():
    first = sh_blocks_after("## Quick start")[0].strip()
    assert first.startswith("python3 -m venv .venv && . .venv/bin/activate && python -m pip install '.[examples]'")
    assert first.endswith("python examples/demo.py")


def test_the_sep_link_goes_to_the_sep():
    assert "[SEP-2663](https://github.com/modelcontextprotocol/modelcontextprotocol/pull/2663)" in README
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
    assert "## [Unreleased]" in (ROOT / "CHANGELOG.md").read_text()


def test_the_walkthrough_s_start_waits_for_the_proxy_instead_of_racing_it():
    """The three lines that start the server and the proxy in the background, then ask /readyz, as a user pastes
    them (on ports of this test's own: the environment moves the proxy, the server takes its port argument)."""
    block = sh_blocks_after("## The wire, by hand (curl)")[0]
    server_port, proxy_port = free_port(), free_port()
    script = block.replace("9000", str(server_port)).replace("8080", str(proxy_port))
    env = {**os.environ, "MCP_TASKS_PROXY_PORT": str(proxy_port),
           "MCP_TASKS_PROXY_UPSTREAM": f"http://127.0.0.1:{server_port}/mcp", "PATH": os.environ["PATH"]}  # fmt: skip
    shell = subprocess.Popen(["bash", "-c", script + "\nkill %1 %2; wait"], cwd=ROOT, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        out, _ = shell.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGTERM)
    assert json.loads(out.strip().splitlines()[-1]) == {"status": "ready", "store": "ok", "upstream": "ok"}
