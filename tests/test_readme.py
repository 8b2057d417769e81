"""The README and the docs site as a user reads them: short enough to read, every link leads somewhere, CI runs the
test command shown, the first commands make their own virtual environment (a stock Debian Python refuses pip outside
one), the site builds with no warning, and the policy reference is generated from the code."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys

from mcp_tasks_proxy.config import ProxyConfig, section_model
from tests.conftest import ROOT, free_port

README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens kept), spaces become hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def sh_blocks_after(title: str, text: str = README) -> list[str]:
    section = text[text.index(title) :]
    return re.findall(r"```sh\n(.*?)```", section, re.S)


def headings_of(text: str) -> set[str]:
    return {slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def test_the_readme_is_a_front_door_and_its_links_lead_somewhere():
    assert len(README.splitlines()) <= 400  # read in ten minutes; the rest is the docs site's
    targets = re.findall(r"\]\(([^)]+)\)", README)
    assert len([target for target in targets if target.startswith("docs/")]) >= 15
    for target in targets:
        if target.startswith("http"):
            continue
        page, _, anchor = target.partition("#")
        text = (ROOT / page).read_text() if page else README
        if anchor:
            assert anchor in headings_of(text), target


def test_the_docs_site_builds_strictly(tmp_path):
    """A broken link or anchor, a page missing from the nav: mkdocs build --strict fails on each."""
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    reference = (tmp_path / "site" / "policy-reference" / "index.html").read_text()
    for key in ("sync_window_ms", "max_backoff_ms", "advertise_url", "MCP_TASKS_PROXY_UPSTREAM", "inherit_env"):
        assert key in reference, key


def test_the_policy_reference_has_every_key_of_the_model():
    sys.path.insert(0, str(DOCS / "_hooks"))
    try:
        import policy_reference
    finally:
        sys.path.pop(0)
    page = policy_reference.render()
    for path, model in policy_reference._sections(ProxyConfig, ""):
        assert f"## `{path or 'top level'}`" in page
        for name, field in model.model_fields.items():
            assert f"| `{name}` |" in page, f"{path}.{name}"
            assert field.description or section_model(field.annotation), f"{path}.{name}: no docstring"


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
    block = sh_blocks_after("# The wire, by hand (curl)", (DOCS / "wire.md").read_text())[0]
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
