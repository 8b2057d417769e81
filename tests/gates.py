"""Gates for test tools: a call waits at one until a test releases it, and records whether it was cancelled.

Standard library only: both test servers use it, the `mcp` 2.x one and the 1.x one in its own environment.
"""

from __future__ import annotations

import asyncio

_gates: dict[str, asyncio.Event] = {}
_states: dict[str, str] = {}
_arrivals: dict[str, int] = {}


async def wait_at(tag: str) -> None:
    """Wait for release(tag); the state says started, then released or cancelled."""
    _states[tag] = "started"
    _arrivals[tag] = _arrivals.get(tag, 0) + 1
    try:
        await _gates.setdefault(tag, asyncio.Event()).wait()
    except asyncio.CancelledError:
        _states[tag] = "cancelled"
        raise
    _states[tag] = "released"


def release(tag: str) -> None:
    _gates.setdefault(tag, asyncio.Event()).set()


def state(tag: str) -> str:
    return _states.get(tag, "unknown")


def arrivals(tag: str) -> int:
    """How many calls have come to this gate: how many times the server ran the tool with this tag."""
    return _arrivals.get(tag, 0)


def arrive(tag: str) -> None:
    """Count a call with this tag that does not wait at a gate."""
    _arrivals[tag] = _arrivals.get(tag, 0) + 1


def arrivals_with(prefix: str) -> dict[str, int]:
    """The arrivals of every tag that starts with `prefix`."""
    return {tag: count for tag, count in _arrivals.items() if tag.startswith(prefix)}


def mark(tag: str, state: str) -> None:
    _states[tag] = state
