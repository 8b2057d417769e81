"""A channel's exchanges in flight, with the calls during which its child may ask something kept apart.

What a child writes on its own names no call (child_initiated.py): it is tied to the one call in flight that may ask,
or to the call whose upstream task its related-task names. Found by a scan of every exchange, that cost each such
line of the child's a step per exchange in flight (6 ms a line at 10,000); here the calls that may ask are grouped as
exchanges come and go, and each call is indexed by its task id when the task is named (CallRoute.name_task).
"""

from __future__ import annotations

from ..routing import Followers
from .exchange import Exchange


class InFlight:
    """The exchanges in flight by the child's id of them, and those that may ask grouped by their call."""

    def __init__(self) -> None:
        self._by_id: dict[str, Exchange] = {}
        self._asking: dict[int, list[Exchange]] = {}
        """The exchanges that may ask, by call (its route, or the exchange itself when it has none), oldest first."""
        self._asking_count = 0
        self._by_task = Followers()

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, child_id: object) -> bool:
        return child_id in self._by_id

    def __getitem__(self, child_id: str) -> Exchange:
        return self._by_id[child_id]

    def get(self, child_id: object) -> Exchange | None:
        return self._by_id.get(child_id)  # type: ignore[call-overload]

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
        group = self._asking.get(key)
        if group is None:
            group = self._asking[key] = []
            if route is not None:
                self._by_task.watch(route)
        group.append(exchange)
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
        self._asking_count = 0
        for group in self._asking.values():
            route = group[0].route
            if route is not None:
                self._by_task.unwatch(route)
        self._asking.clear()
        return exchanges

    def newest_of_task(self, task_id: str) -> Exchange | None:
        """The newest exchange that may ask of the call following upstream task `task_id`."""
        route = self._by_task.first(task_id)
        return self._asking[id(route)][-1] if route is not None else None

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
        if route is not None:
            self._by_task.unwatch(route)
