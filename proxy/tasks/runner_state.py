"""What the runner's parts share: the jobs running on this replica, the store their records go to, and the clocks."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING

from ..metrics import Metrics
from ..store.base import TaskStore
from .deadlines import Deadlines
from .job import Job, Slots
from .precedence import Precedence
from .sealing import CallSeal
from .watchers import TaskWatchers

if TYPE_CHECKING:
    from ..upstream.gateway import Gateway


@dataclasses.dataclass(eq=False, slots=True)
class RunnerState:
    store: TaskStore
    upstream: Gateway
    metrics: Metrics
    now: Callable[[], datetime]
    timer: Callable[[], float]
    replica_id: str
    watchers: TaskWatchers = dataclasses.field(default_factory=TaskWatchers)
    jobs: dict[str, Job] = dataclasses.field(default_factory=dict)
    """The calls this replica runs, by task id, from admission until their asyncio task ends."""
    deadlines: Deadlines = dataclasses.field(default_factory=Deadlines)
    """The calls' time limits (timeout_s)."""
    precedence: Precedence = dataclasses.field(default_factory=Precedence)
    """The creations being answered, which the tasks' upstream calls and settlements give way to."""
    accepting: bool = True
    """False once shutdown began: no new task is taken."""
    slots_for: Callable[[str, str], Slots | None] = lambda tool, caller: None
    """The slots a call of a tool by a caller needs under the concurrency limits (proxy/front/concurrency.py)."""
    seal: CallSeal | None = None
    """With a shared store and an operator's principal key: seals calls for another replica to take over."""
