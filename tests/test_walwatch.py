"""The SQLite watch (walwatch.py): a write to the WAL by any connection ends a ``wait``,
and writes that come while nobody waits are kept for the next ``wait``, never lost."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator, Iterator

import pytest

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
