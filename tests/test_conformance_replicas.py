"""The conformance suite's tasks-* and input-required-result-* scenarios through three replicas behind a plain
round-robin balancer, each replica with its own copy of the 2026-07-28 fixture server as its stdio child (a sidecar
per pod), sharing a real redis-server, sessions routed (listen.advertise_url).

Every request of a scenario may land on another replica. A task is found anywhere through the store; a synchronous
MRTR retry carries the child's own requestState, which only the copy whose SDK sealed it can read: the proxy's
handle names that replica and that copy, and the retry is forwarded there. The column must match the single
proxy's (tests/test_conformance.py, tests/test_conformance_mrtr.py).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import yaml

from tests import test_conformance as tasks_conformance
from tests import test_conformance_mrtr as mrtr_conformance
from tests.test_any_replica import balanced  # noqa: F401  (a fixture)

suite = tasks_conformance.suite

SCENARIOS = [
    *(name for name in tasks_conformance.SCENARIOS if name not in tasks_conformance.SKIPPED_BY_THE_SUITE),
    *mrtr_conformance.SCENARIOS,
]


@pytest.mark.timeout(900)
async def test_the_round_robin_stdio_2026_column_matches_the_single_proxys(suite, replicas, balanced, tmp_path: Path):  # noqa: F811
    policy = yaml.safe_load((tasks_conformance.HERE / "policy.yaml").read_text())
    fixture = [sys.executable, str(tasks_conformance.HERE / "fixture_server.py"), "--stdio"]
    proxies = [replicas(fixture, advertise=True, tools=policy["tools"], **policy["tasks"]) for _ in range(3)]
    url, balancer = await balanced(proxies)
    failed = {}
    for number, scenario in enumerate(SCENARIOS):
        out = tmp_path / str(number)
        # In a thread: the balancer relaying the suite's requests runs on this event loop.
        failure = await asyncio.to_thread(mrtr_conformance.scenario_failures, suite, url, scenario, out, legacy=False)
        if failure is not None:
            failed[scenario] = failure
    assert {index for index, _, _ in balancer.hits} == {0, 1, 2}
    assert not failed, "\n".join(f"{scenario}: {failure}" for scenario, failure in failed.items())
