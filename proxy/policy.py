"""The policy in force, and its live reload (SIGHUP or a change of the file) without a restart."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable

import structlog

from .config import ConfigError, ProxyConfig

log = structlog.get_logger(__name__)

# What a reload can change; the rest (listen address, upstream, store, body limit) is bound at start.
RELOADABLE = ("tools", "tasks", "logging")


class LivePolicy:
    """Holds the configuration requests read; a reload swaps it whole, so a request sees one policy or the other.

    A running task keeps the rule it started with: the runner copied what it needs when the task was created.
    """

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config

    def replace(self, new: ProxyConfig) -> list[str]:
        """Apply the reloadable sections of `new`; return the sections that differ but need a restart."""
        fixed = [name for name in ProxyConfig.model_fields if name not in RELOADABLE]
        needs_restart = [name for name in fixed if getattr(new, name) != getattr(self.config, name)]
        self.config = self.config.model_copy(update={name: getattr(new, name) for name in RELOADABLE})
        return needs_restart


FileStamp = tuple[int, int, int]


def file_stamp(path: str) -> FileStamp | None:
    """What tells one version of a file from the next: mtime, size and inode (a ConfigMap swaps a symlink)."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_mtime_ns, info.st_size, info.st_ino


class PolicyReloader:
    """Re-reads the policy file on SIGHUP and when it changes on disk; an invalid file leaves the policy as it is."""

    def __init__(
        self,
        policy: LivePolicy,
        path: str,
        load: Callable[[], ProxyConfig],
        *,
        interval_s: float = 2.0,
        loaded_stamp: FileStamp | None = None,
    ):
        self._policy = policy
        self._path = path
        self._load = load
        self._interval_s = interval_s
        # The file as it was when the policy in force was read (taken before reading): a change made while the
        # proxy was starting is still a change.
        self._seen = loaded_stamp if loaded_stamp is not None else file_stamp(path)
        self._watcher: asyncio.Task[None] | None = None

    def _stamp(self) -> FileStamp | None:
        return file_stamp(self._path)

    def reload(self, reason: str = "manual") -> bool:
        try:
            new = self._load()
        except ConfigError as exc:
            log.error("policy_reload_refused", reason=reason, error=str(exc), rules=len(self._policy.config.tools))
            return False
        needs_restart = self._policy.replace(new)
        log.info("policy_reloaded", reason=reason, rules=len(new.tools), needs_restart=needs_restart or None)
        return True

    async def _watch(self) -> None:
        # Polling the file's stamp: no extra dependency, and it sees ConfigMap updates (a symlink swap) too.
        while True:
            await asyncio.sleep(self._interval_s)
            stamp = self._stamp()
            if stamp is not None and stamp != self._seen:
                self._seen = stamp
                self.reload("file changed")

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError):  # no signals off the main thread
            loop.add_signal_handler(signal.SIGHUP, self.reload, "SIGHUP")
        self._watcher = asyncio.ensure_future(self._watch())

    async def stop(self) -> None:
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
