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

The first event after a ``wait`` stops the watching until the next ``wait``: the kernel
keeps what comes meanwhile, merging repeats, and that ``wait`` returns at once if
anything came. A producer committing back to back would otherwise be woken by each of
its own commits.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import os
import sys

from ...storage import Events

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


class WalWatch(Events):
    """Events for writes to ``<database>-wal``; ``wait`` returns when one came."""

    def __init__(self, database: str) -> None:
        super().__init__()
        self.path = database + "-wal"
        self._fd = -1
        self._loop: asyncio.AbstractEventLoop | None = None
        self._armed = False  # the loop watches the descriptor

    @property
    def active(self) -> bool:
        """True when writes wake the watch (inotify); False: only timeouts do."""
        return self._fd >= 0

    async def start(self) -> None:
        """Watch the WAL file if this system can (then ``active``)."""
        libc = _inotify()
        if libc is None or not os.path.exists(self.path):
            return
        fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            return
        if libc.inotify_add_watch(fd, os.fsencode(self.path), _IN_MODIFY) < 0:
            os.close(fd)
            return
        self._fd = fd
        self._loop = asyncio.get_running_loop()
        self._arm()

    async def wait(self, timeout: float) -> float | None:
        if self._fd >= 0 and not self._armed:
            if self._drain():  # written since the last event: an event now
                self.wake()
            self._arm()
        return await super().wait(timeout)

    async def close(self) -> None:
        if self._fd >= 0:
            if self._armed and self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1

    def _arm(self) -> None:
        assert self._loop is not None
        self._loop.add_reader(self._fd, self._on_readable)
        self._armed = True

    def _on_readable(self) -> None:
        assert self._loop is not None
        self._loop.remove_reader(self._fd)  # until the next wait
        self._armed = False
        self._drain()
        self.wake()

    def _drain(self) -> bool:
        """Read the pending events (they say nothing more than "written"); True if any."""
        read = False
        with contextlib.suppress(BlockingIOError, InterruptedError):
            while os.read(self._fd, 65536):
                read = True
        return read
