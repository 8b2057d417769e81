"""A channel's exchanges in flight, with the calls during which its child may ask something kept apart.

What a child writes on its own names no call (child_initiated.py): it is tied to the one call in flight that may ask,
or to the call whose upstream task its related-task names. Found by a scan of every exchange, that cost each such
line of the child's a step per exchange in flight (6 ms a line at 10,000); here the calls that may ask are grouped as
exchanges come and go, and a task id finds its call through an index.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..routing import CallRoute
from .exchange import Exchange


class InFlight:
    """The exchanges in flight by the child's id of them, and those that may ask grouped by their call."""

    def __init__(self) -> None:
        self._by_id: dict[str, Exchange] = {}
        self._asking: dict[int, list[Exchange]] = {}
        """The exchanges that may ask, by call (its route, or the exchange itself when it has none), oldest first."""
        self._asking_count = 0
        self._by_task: dict[str, list[int]] = {}
        """Calls by the id of the upstream task they follow (two may follow one: the first found is the oldest)."""
        self._unnamed: dict[int, CallRoute] = {}
        """Calls that run as an upstream task whose id was not known yet when last looked (legacy_tasks.py names it
        while the call runs): indexed by task id at the next lookup, each once."""

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, child_id: object) -> bool:
        return child_id in self._by_id

    def __getitem__(self, child_id: str) -> Exchange:
        return self._by_id[child_id]

    def get(self, child_id: object) -> Exchange | None:
        return self._by_id.get(child_id)  # type: ignore[call-overload]

    def values(self) -> Iterator[Exchange]:
        return iter(self._by_id.values())

    @property
    def asking(self) -> int:
        """Exchanges during which the child may ask something."""
        return self._asking_count

    @property
    def calls_asking(self) -> int:
        """Calls (a call's exchanges counted once) during which the child may ask something."""
        return len(self._asking)

    def add(self, exchange: Exchange) -> None:
        self._by_id[exchange.child_id] = exchange
        if not exchange.may_ask:
            return
        route = exchange.route
        key = id(route) if route is not None else id(exchange)
        self._asking.setdefault(key, []).append(exchange)
        if route is not None and route.upstream_task:  # (set by legacy.py before the call's first request)
            if route.upstream_task_id is None:
                self._unnamed[key] = route
            else:
                self._index(route.upstream_task_id, key)
        self._asking_count += 1

    def pop(self, child_id: object) -> Exchange | None:
        exchange = self._by_id.pop(child_id, None)  # type: ignore[call-overload]
        if exchange is not None and exchange.may_ask:
            self._leave(exchange)
        return exchange

    def clear(self) -> list[Exchange]:
        """Empty it; what was in it."""
        exchanges = list(self._by_id.values())
        self._by_id.clear()
        self._asking.clear()
        self._asking_count = 0
        self._by_task.clear()
        self._unnamed.clear()
        return exchanges

    def newest_of_task(self, task_id: str) -> Exchange | None:
        """The newest exchange that may ask of the call following upstream task `task_id`."""
        for key, route in list(self._unnamed.items()):
            if route.upstream_task_id is not None:
                del self._unnamed[key]
                self._index(route.upstream_task_id, key)
        keys = self._by_task.get(task_id)
        return self._asking[keys[0]][-1] if keys else None

    def the_one_asking(self) -> Exchange | None:
        """The newest exchange that may ask of the one call that may, when there is exactly one."""
        if len(self._asking) != 1:
            return None
        return next(iter(self._asking.values()))[-1]

    def _leave(self, exchange: Exchange) -> None:
        route = exchange.route
        key = id(route) if route is not None else id(exchange)
        group = self._asking.get(key)
        if group is None or exchange not in group:
            return
        group.remove(exchange)
        self._asking_count -= 1
        if group:
            return
        del self._asking[key]
        self._unnamed.pop(key, None)
        task_id = route.upstream_task_id if route is not None else None
        keys = self._by_task.get(task_id) if task_id is not None else None
        if keys is not None and key in keys:
            keys.remove(key)
            if not keys:
                del self._by_task[task_id]  # type: ignore[arg-type]

    def _index(self, task_id: str, key: int) -> None:
        keys = self._by_task.setdefault(task_id, [])
        if key not in keys:
            keys.append(key)
