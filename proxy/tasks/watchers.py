"""Who on this replica listens for changes of which task: subscriptions/listen and durable calls' streams."""

from __future__ import annotations

import asyncio


class TaskWatchers:
    """Who listens (subscriptions/listen on this replica) for changes of which task."""

    def __init__(self) -> None:
        self._queues: dict[str, set[asyncio.Queue[str]]] = {}
        self._progress: set[asyncio.Queue[str]] = set()
        """Queues that also want progress (a durable call's stream); listen streams want transitions only."""

    def watch(self, task_ids: list[str], *, progress: bool = False) -> asyncio.Queue[str]:
        queue: asyncio.Queue[str] = asyncio.Queue()
        for task_id in task_ids:
            self._queues.setdefault(task_id, set()).add(queue)
        if progress:
            self._progress.add(queue)
        return queue

    def unwatch(self, task_ids: list[str], queue: asyncio.Queue[str]) -> None:
        for task_id in task_ids:
            queues = self._queues.get(task_id)
            if queues is not None:
                queues.discard(queue)
                if not queues:
                    del self._queues[task_id]
        self._progress.discard(queue)

    def changed(self, task_id: str) -> None:
        for queue in self._queues.get(task_id, ()):
            queue.put_nowait(task_id)

    def progressed(self, task_id: str) -> None:
        for queue in self._queues.get(task_id, ()):
            if queue in self._progress:
                queue.put_nowait(task_id)

    def watched(self) -> list[str]:
        return list(self._queues)
