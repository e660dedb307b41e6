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

The first event after a ``wait`` stops the watching until the next ``wait``: what comes
meanwhile is kept, and that ``wait`` returns at once if anything came. A producer
committing back to back would otherwise be woken by each of its own commits.

Every watch of an event loop shares one inotify instance (``_Inotify``), each file a
watch of its own on it: a process serving hundreds of producers holds one, not one each
(the kernel allows 128 instances per user by default). The loop reads the instance only
while some watch waits. Where a watch cannot be had (a limit reached), the producer says
so once, naming the limit, and checks every 50 ms instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import errno
import logging
import os
import struct
import sys
import weakref

from ...producer.storage import Events

logger = logging.getLogger("streamq.producer")

_IN_MODIFY = 0x00000002
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then a name)

# Where a limit stops a watch: the sysctl to raise, by errno.
_LIMITS = {
    errno.EMFILE: "fs.inotify.max_user_instances",
    errno.ENOSPC: "fs.inotify.max_user_watches",
}
_warned: set[str] = set()  # what this process said already


def _inotify() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.inotify_init1  # noqa: B018 (present in glibc and musl)
    except (OSError, AttributeError):
        return None
    return libc


def _cannot_watch(path: str, what: str, code: int) -> None:
    """Say once per process and reason that a watch could not be had, and what to raise."""
    limit = _LIMITS.get(code)
    reason = limit or os.strerror(code)
    if reason in _warned:
        return
    _warned.add(reason)
    if limit is not None:
        try:
            with open("/proc/sys/" + limit.replace(".", "/")) as file:
                value = file.read().strip()
        except OSError:
            value = "?"
        why = f"the kernel's limit {limit} ({value}) is reached; raise it (sysctl -w {limit}=...)"
    else:
        why = os.strerror(code)
    logger.warning(
        "cannot watch %s for commits (%s: %s): commits by other connections and processes "
        "are seen by checking every 50 ms instead, here and for any other database this "
        "process cannot watch",
        path,
        what,
        why,
    )


class _Inotify:
    """One event loop's inotify instance, shared by its watches (one inotify watch per
    file). Read while some watch waits; each event goes to the watches of its file."""

    def __init__(self, libc: ctypes.CDLL, fd: int, loop: asyncio.AbstractEventLoop) -> None:
        self._libc, self._fd, self._loop = libc, fd, loop
        self._by_wd: dict[int, set[WalWatch]] = {}
        self._waiting: set[WalWatch] = set()
        self._reading = False  # the loop watches the descriptor

    @classmethod
    def for_loop(cls, libc: ctypes.CDLL, path: str) -> _Inotify | None:
        loop = asyncio.get_running_loop()
        shared = _INSTANCES.get(loop)
        if shared is None:
            fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
            if fd < 0:
                _cannot_watch(path, "inotify_init1", ctypes.get_errno())
                return None
            shared = _INSTANCES[loop] = cls(libc, fd, loop)
        return shared

    def add(self, watch: WalWatch) -> int | None:
        """Watch ``watch.path``; its watch descriptor, or None if none could be had."""
        wd = int(self._libc.inotify_add_watch(self._fd, os.fsencode(watch.path), _IN_MODIFY))
        if wd < 0:
            _cannot_watch(watch.path, "inotify_add_watch", ctypes.get_errno())
            self._close_if_unused()
            return None
        self._by_wd.setdefault(wd, set()).add(watch)
        return wd

    def remove(self, watch: WalWatch, wd: int) -> None:
        self._waiting.discard(watch)
        watches = self._by_wd.get(wd, set())
        watches.discard(watch)
        if not watches:
            self._by_wd.pop(wd, None)
            self._libc.inotify_rm_watch(self._fd, wd)
        self._update_reader()
        self._close_if_unused()

    def wait_for(self, watch: WalWatch) -> None:
        """``watch`` waits: what came since is read first (ending its wait at once if
        its file was written), and the next event for its file will end it."""
        self._read()
        self._waiting.add(watch)
        self._update_reader()

    def _on_readable(self) -> None:
        self._read()
        self._update_reader()

    def _read(self) -> None:
        """Every pending event to the watches of its file."""
        with contextlib.suppress(BlockingIOError, InterruptedError):
            while data := os.read(self._fd, 65536):
                offset = 0
                while offset < len(data):
                    wd, _, _, size = _EVENT.unpack_from(data, offset)
                    offset += _EVENT.size + size
                    # wd -1: the kernel's queue overflowed, events were dropped: wake all.
                    watches = self._by_wd.get(wd, ()) if wd >= 0 else self._every_watch()
                    for watch in watches:
                        self._waiting.discard(watch)  # the first event stops the watching
                        watch.wake()

    def _every_watch(self) -> list[WalWatch]:
        return [watch for watches in self._by_wd.values() for watch in watches]

    def _update_reader(self) -> None:
        if self._loop.is_closed():
            return
        if self._waiting and not self._reading:
            self._loop.add_reader(self._fd, self._on_readable)
            self._reading = True
        elif not self._waiting and self._reading:
            self._loop.remove_reader(self._fd)
            self._reading = False

    def _close_if_unused(self) -> None:
        if self._by_wd or self._fd < 0:
            return
        if self._reading and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        self._reading = False
        os.close(self._fd)
        self._fd = -1
        if _INSTANCES.get(self._loop) is self:
            del _INSTANCES[self._loop]


_INSTANCES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Inotify] = (
    weakref.WeakKeyDictionary()
)


class WalWatch(Events):
    """Events for writes to ``<database>-wal``; ``wait`` returns when one came."""

    def __init__(self, database: str) -> None:
        super().__init__()
        self.path = database + "-wal"
        self._inotify: _Inotify | None = None
        self._wd = -1

    @property
    def active(self) -> bool:
        """True when writes wake the watch (inotify); False: only timeouts do."""
        return self._inotify is not None

    async def start(self) -> None:
        """Watch the WAL file if this system can (then ``active``)."""
        libc = _inotify()
        if libc is None or not os.path.exists(self.path):
            return
        shared = _Inotify.for_loop(libc, self.path)
        wd = None if shared is None else shared.add(self)
        if shared is not None and wd is not None:
            self._inotify, self._wd = shared, wd
            shared.wait_for(self)

    async def wait(self, timeout: float) -> float | None:
        if self._inotify is not None:
            self._inotify.wait_for(self)
        return await super().wait(timeout)

    async def close(self) -> None:
        if self._inotify is not None:
            self._inotify.remove(self, self._wd)
            self._inotify, self._wd = None, -1
