"""Wake the serving producer when any process commits to its database, without polling.

Every commit to a SQLite database in WAL mode appends frames to its ``-wal`` file,
whoever commits: this producer, another process, the application's own connection or
ORM, which streamq never sees commit (Python's ``sqlite3`` has no commit hook). On Linux,
inotify reports each write to that file at once; the producer then asks SQLite whether
another connection committed (``PRAGMA data_version``), and the database stays the truth.

Writes are not commits: an event may come just before the commit it belongs to is
visible, and this producer's own commits cause events too. Callers recheck once shortly
after an event that found nothing new, and keep a slow periodic check besides, so a
missed event delays a record and never loses it. Elsewhere than Linux, only the periodic
check runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import os
import sys
import time

_IN_MODIFY = 0x00000002
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC


def _inotify() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.inotify_init1  # noqa: B018 (present in glibc and musl)
    except (OSError, AttributeError):
        return None
    return libc


class WalWatch:
    """Events for writes to ``<database>-wal``; ``wait`` returns when one came."""

    def __init__(self, database: str) -> None:
        self.path = database + "-wal"
        self._fd = -1
        self._event = asyncio.Event()
        self._first_event_at: float | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def active(self) -> bool:
        """True when writes wake the watch (inotify); False: only timeouts do."""
        return self._fd >= 0

    def start(self) -> bool:
        """Watch the WAL file if this system can; returns ``active``."""
        libc = _inotify()
        if libc is None or not os.path.exists(self.path):
            return False
        fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            return False
        if libc.inotify_add_watch(fd, os.fsencode(self.path), _IN_MODIFY) < 0:
            os.close(fd)
            return False
        self._fd = fd
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(fd, self._on_readable)
        return True

    def close(self) -> None:
        if self._fd >= 0:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1

    def _on_readable(self) -> None:
        with contextlib.suppress(BlockingIOError, InterruptedError):
            while os.read(self._fd, 65536):  # the events say nothing more than "written"
                pass
        if self._first_event_at is None:
            self._first_event_at = time.monotonic()
        self._event.set()

    def wake(self) -> None:
        """Wake ``wait`` as an event would (a commit made in this process)."""
        if self._first_event_at is None:
            self._first_event_at = time.monotonic()
        self._event.set()

    async def wait(self, timeout: float) -> float | None:
        """Wait for a write, at most ``timeout`` seconds: when the first write since the
        last ``wait`` came (``time.monotonic``), or None after the timeout."""
        if not self._event.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._event.wait()
        self._event.clear()
        first, self._first_event_at = self._first_event_at, None
        return first
