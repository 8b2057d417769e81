"""The poll interval an upstream SEP-1686 task asks for is bounded, whatever number it sends."""

from __future__ import annotations

import pytest

from mcp_tasks_proxy.upstream.legacy_tasks import _poll_s


@pytest.mark.parametrize(
    ("interval", "seconds"),
    [(1000, 1.0), (0, 0.05), (-5, 0.05), (10**400, 5.0), (1e12, 5.0), (float("nan"), 1.0), (float("inf"), 1.0),
     (True, 1.0), ("500", 1.0), (None, 1.0)],
)  # fmt: skip
def test_a_hostile_poll_interval_is_bounded(interval, seconds):
    assert _poll_s({"pollInterval": interval}) == seconds
