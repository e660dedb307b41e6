"""The SQLite watch (walwatch.py): a write to the WAL by any connection ends a ``wait``,
and writes that come while nobody waits are kept for the next ``wait``, never lost."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import os
import sqlite3
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import cast

import pytest

from streamq.engines.sqlite import walwatch
from streamq.engines.sqlite.walwatch import WalWatch

LONG = 30.0  # s: a wait that must end on an event, long before this


@pytest.fixture
def other(producer_db: str) -> Iterator[sqlite3.Connection]:
    """Another connection to the database, in WAL mode: the WAL file exists."""
    conn = sqlite3.connect(producer_db, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE t (v)")
    yield conn
    conn.close()


@pytest.fixture
async def watch(producer_db: str, other: sqlite3.Connection) -> AsyncIterator[WalWatch]:
    watch = WalWatch(producer_db)
    await watch.start()
    assert watch.active, "inotify is available on Linux"
    yield watch
    await watch.close()


def commit(conn: sqlite3.Connection) -> None:
    conn.execute("INSERT INTO t VALUES (1)")


async def test_a_commit_ends_a_wait(watch: WalWatch, other: sqlite3.Connection) -> None:
    waiting = asyncio.create_task(watch.wait(LONG))
    await asyncio.sleep(0)  # waiting now
    commit(other)
    async with asyncio.timeout(LONG / 2):
        assert await waiting is not None


async def test_without_writes_a_wait_times_out(watch: WalWatch) -> None:
    assert await watch.wait(0.05) is None


async def test_writes_between_waits_end_the_next_wait_at_once(
    watch: WalWatch, other: sqlite3.Connection
) -> None:
    commit(other)
    async with asyncio.timeout(LONG / 2):
        assert await watch.wait(LONG) is not None  # the first event stops the watching
    for _ in range(3):
        commit(other)  # nobody waiting, and the watch not watching
    for _ in range(10):
        await asyncio.sleep(0)
    async with asyncio.timeout(LONG / 2):
        assert await watch.wait(LONG) is not None  # kept for this wait
    assert await watch.wait(0.05) is None  # and read: nothing more came


async def test_waits_go_on_after_many_events(watch: WalWatch, other: sqlite3.Connection) -> None:
    for _ in range(5):
        waiting = asyncio.create_task(watch.wait(LONG))
        await asyncio.sleep(0)
        commit(other)
        async with asyncio.timeout(LONG / 2):
            assert await waiting is not None
    assert await watch.wait(0.05) is None


async def test_close_stops_watching(watch: WalWatch, other: sqlite3.Connection) -> None:
    await watch.close()
    assert not watch.active
    commit(other)  # no reader left on a closed descriptor
    await asyncio.sleep(0)


def inotify_instances() -> int:
    """inotify instances this process holds."""
    fds = os.listdir("/proc/self/fd")
    links = []
    for fd in fds:
        with contextlib.suppress(OSError):
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
    return sum(link == "anon_inode:inotify" for link in links)


async def test_watches_of_a_loop_share_one_instance_and_wake_only_their_own(
    tmp_path: Path,
) -> None:
    """Hundreds of producers in a process must not take an inotify instance each (the
    kernel allows 128 per user by default): one per event loop, each file a watch on it."""
    before = inotify_instances()
    conns, watches = [], []
    try:
        for i in range(20):
            path = str(tmp_path / f"p{i}.db")
            conn = sqlite3.connect(path, isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("CREATE TABLE t (v)")
            conns.append(conn)
            watch = WalWatch(path)
            await watch.start()
            assert watch.active
            watches.append(watch)
        assert inotify_instances() == before + 1
        waiting = [asyncio.create_task(w.wait(LONG)) for w in watches]
        await asyncio.sleep(0)
        commit(conns[7])
        async with asyncio.timeout(LONG / 2):
            assert await waiting[7] is not None
        for _ in range(10):
            await asyncio.sleep(0)
        assert [i for i, task in enumerate(waiting) if task.done()] == [7]
        commit(conns[3])
        async with asyncio.timeout(LONG / 2):
            assert await waiting[3] is not None
        for task in waiting:
            task.cancel()
    finally:
        for watch in watches:
            await watch.close()
        for conn in conns:
            conn.close()
    assert inotify_instances() == before  # closed with its last watch


class _NumberedWatches:
    """libc's inotify watch calls, numbering watches: for an instance read from a pipe."""

    def __init__(self) -> None:
        self.added = 0

    def inotify_add_watch(self, fd: int, path: bytes, mask: int) -> int:
        self.added += 1
        return self.added


async def test_an_overflowed_event_queue_wakes_every_watch(tmp_path: Path) -> None:
    """The kernel drops events when its queue overflows, and says so with an event for
    watch -1: any watch may have lost one, so every watch wakes, waiting or not."""
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    try:
        fake = cast(ctypes.CDLL, _NumberedWatches())
        shared = walwatch._Inotify(fake, read_end, asyncio.get_running_loop())
        watches = [WalWatch(str(tmp_path / f"p{i}.db")) for i in range(3)]
        for watch in watches:
            assert shared.add(watch) is not None
        os.write(write_end, walwatch._EVENT.pack(2, 0x2, 0, 0))  # IN_MODIFY of the second
        shared._read()
        assert [await watch.wait(0) is not None for watch in watches] == [False, True, False]
        os.write(write_end, walwatch._EVENT.pack(-1, 0x4000, 0, 0))  # IN_Q_OVERFLOW
        shared._read()
        assert [await watch.wait(0) is not None for watch in watches] == [True, True, True]
    finally:
        os.close(read_end)
        os.close(write_end)


class _NoWatchesLeft:
    """libc's inotify calls, with the kernel's watch limit reached (ENOSPC), as on a
    machine hosting more watched files than ``fs.inotify.max_user_watches``."""

    def __init__(self, libc: ctypes.CDLL) -> None:
        self._libc = libc

    def inotify_init1(self, flags: int) -> int:
        return int(self._libc.inotify_init1(flags))

    def inotify_add_watch(self, fd: int, path: bytes, mask: int) -> int:
        ctypes.set_errno(errno.ENOSPC)
        return -1

    def inotify_rm_watch(self, fd: int, wd: int) -> int:
        return int(self._libc.inotify_rm_watch(fd, wd))


async def test_a_watch_that_cannot_be_had_is_said_once_naming_the_limit(
    producer_db: str,
    other: sqlite3.Connection,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    libc = walwatch._inotify()
    assert libc is not None, "inotify is available on Linux"
    monkeypatch.setattr(walwatch, "_inotify", lambda: _NoWatchesLeft(libc))
    monkeypatch.setattr(walwatch, "_warned", set())
    before = inotify_instances()
    for _ in range(3):
        watch = WalWatch(producer_db)
        await watch.start()
        assert not watch.active  # the producer checks every 50 ms instead
        await watch.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    assert "fs.inotify.max_user_watches" in warnings[0] and "sysctl" in warnings[0]
    assert "every 50 ms" in warnings[0]
    assert inotify_instances() == before  # the instance made for it is closed again
