"""The official MCP conformance suite's input-required-result-* scenarios (SEP-2322, MRTR), run against the proxy in
front of the conformance fixture servers, in the columns of tests/test_conformance.py (tasks_conformance.proxied):
modern, legacy, each started by the proxy as a stdio child, under tests/conformance/policy.yaml, and the 2025 stdio
child again with dispatch: shared.

The modern fixture answers MRTR rounds itself (InputRequiredResult, its SDK sealing requestState); the legacy one asks
2025-style, with requests on the call's stream, which the proxy turns into rounds whose requestState is its handle to
the parked call. One proxy serves a column's scenarios in turn, as it serves clients: a round the suite reads and
never retries keeps its call open upstream for upstream.round_wait_s.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import test_conformance as tasks_conformance

# The suite, as the tasks-* scenarios run it.
suite = tasks_conformance.suite


COLUMNS = ["modern", "legacy", "modern-stdio", "legacy-stdio", "legacy-stdio-shared"]


@pytest.fixture(params=COLUMNS)
def column(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A column's name and its proxy's URL: the tasks-* columns, and a 2025 stdio child with shared dispatch too
    (where one round walked away from once made every later question of the column ambiguous)."""
    with tasks_conformance.proxied(request.param, tmp_path_factory.mktemp("column")) as url:
        yield request.param, url


PREFIX = "input-required-result-"
SCENARIOS = [
    f"{PREFIX}{name}"
    for name in (
        "basic-elicitation",
        "basic-sampling",
        "basic-list-roots",
        "request-state",
        "multiple-input-requests",
        "multi-round",
        "missing-input-response",
        "non-tool-request",
        "result-type",
        "unsupported-methods",
        "tampered-state",
        "capability-check",
        "ignore-extra-params",
        "validate-input",
    )
]

# What a 2025 server cannot do, whoever is in front of it: it names no question (the keys of its rounds are the
# proxy's, `elicitation-<id>`), and it takes an answer only to a question it has asked. In the legacy columns these
# checks must fail with these messages, and every other check pass: a change on either side is noticed here.
LEGACY_CANNOT = {
    f"{PREFIX}basic-elicitation": {"sep-2322-elicitation-incomplete": 'inputRequests missing expected key "user_name"'},
    f"{PREFIX}ignore-extra-params": {"sep-2322-ignore-unexpected-params": "Server did not return complete result"},
}


@pytest.mark.timeout(900)  # the first test of a worker may wait for another one's npm install of the suite
def test_the_suite_has_no_input_required_result_scenario_we_do_not_run(suite):
    listed = subprocess.run([*suite, "list", "--server"], capture_output=True, text=True, timeout=120, check=True)
    names = [line.split()[1] for line in listed.stdout.splitlines() if line.strip().startswith(f"- {PREFIX}")]
    assert sorted(names) == sorted(SCENARIOS)


def scenario_failures(suite: list[str], url: str, scenario: str, out: Path, *, legacy: bool) -> str | None:
    """What went wrong with one scenario through the proxy at `url`; None when nothing did."""
    # Each request of the suite gives up after 10 s, so a scenario ends well within the subprocess's bound.
    done, checks = tasks_conformance.run_scenario(suite, url, scenario, out, timeout_s=120)
    if checks is None:
        return done.stdout[-2000:] + done.stderr[-2000:]
    failures = [check for check in checks if check["status"] not in ("SUCCESS", "INFO")]
    seen = {check["id"]: check.get("errorMessage") or "" for check in failures}
    expected = LEGACY_CANNOT.get(scenario, {}) if legacy else {}
    if seen.keys() != expected.keys() or not all(seen[id_].startswith(text) for id_, text in expected.items()):
        return json.dumps(failures, indent=1)[:2000]
    return None if expected or done.returncode == 0 else done.stdout[-2000:]


@pytest.mark.timeout(600)
def test_every_scenario_of_the_column_passes_in_turn(suite, column, tmp_path: Path):
    """All of a column's scenarios, one after the other through one proxy, as one client would run them: the rounds
    a scenario walks away from (basic-elicitation, missing-input-response, result-type, tampered-state) are still
    open when the next ones run."""
    name, url = column
    failed = {}
    for number, scenario in enumerate(SCENARIOS):
        failure = scenario_failures(suite, url, scenario, tmp_path / str(number), legacy=name.startswith("legacy"))
        if failure is not None:
            failed[scenario] = failure
    assert not failed, "\n".join(f"{scenario}: {failure}" for scenario, failure in failed.items())
