"""A bounded table of sessions that ends only idle ones to make room, and refuses a new one when all are busy.

A plain LRU ends the least recently used session whatever it is doing, so whoever opens sessions fastest ends other
callers' running calls. Here a session that is busy (a call in flight, a stream open) is never ended to make room;
at the bound, the least recently used idle one goes, and when there is none the new session is refused.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

K = TypeVar("K")
S = TypeVar("S")


class SessionsFull(Exception):
    """Every session within a bound is busy: a new one is refused (the message says which bound)."""


class SessionTable(Generic[K, S]):
    """Sessions by key, least recently used first."""

    def __init__(self, max_size: int, *, is_busy: Callable[[S], bool], on_end: Callable[[K, S], None]) -> None:
        self.max_size = max_size
        self._is_busy = is_busy
        self._on_end = on_end
        self._items: collections.OrderedDict[K, S] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def values(self) -> list[S]:
        return list(self._items.values())

    def get(self, key: K) -> S | None:
        """The session, now the most recently used."""
        session = self._items.get(key)
        if session is not None:
            self._items.move_to_end(key)
        return session

    def make_room(self, *, what: str) -> None:
        """Room for one more: when the table is full, its least recently used idle session is ended; SessionsFull,
        naming the `what` bound, when every one is busy."""
        if len(self._items) >= self.max_size and not self.end_idlest(self._items):
            raise SessionsFull(f"all {self.max_size} sessions are busy ({what})")

    def add(self, key: K, session: S, *, what: str) -> None:
        """Add a session (making room for it first)."""
        if key not in self._items:
            self.make_room(what=what)
        self._items[key] = session
        self._items.move_to_end(key)

    def end_idlest(self, among: Iterable[K]) -> bool:
        """End the least recently used idle session of `among` (keys in least recently used order); False when
        every one of them is busy."""
        for key in among:
            session = self._items[key]
            if not self._is_busy(session):
                self.end(key)
                return True
        return False

    def end(self, key: K) -> S | None:
        """Remove the session and tell `on_end`; None when there is none."""
        session = self._items.pop(key, None)
        if session is not None:
            self._on_end(key, session)
        return session

    def pop(self, key: K) -> S | None:
        """Remove the session without telling `on_end` (it ended on its own)."""
        return self._items.pop(key, None)
