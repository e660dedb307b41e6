"""WAL checkpoints on a connection of their own, so that no commit waits for one
(``durability="normal"``).

SQLite copies the WAL back into the database file (a checkpoint) from inside the COMMIT
that takes the WAL past 1,000 pages: that commit pays for copying the pages and an fsync
of the database file, milliseconds, and every record published meanwhile waits behind
it. On the event loop's thread (short transactions run there) it stalls the producer
outright. The writer connection hands that job to a ``Checkpointer`` instead: a task that
runs ``PRAGMA wal_checkpoint(PASSIVE)`` on its own connection and thread, which copies
what no reader still needs while the writer goes on committing. The writer keeps an
automatic checkpoint only far beyond the usual size (``WRITER_AUTOCHECKPOINT``), should
this one fall behind or stop.

It learns of commits from the WAL file's size and modification time (``os.stat``) and
never opens the database's files itself: closing any descriptor of a file drops every
POSIX lock the process holds on it, SQLite's included. While nothing is written it does
not look at all: the WAL's watch (``walwatch``, inotify, which takes a path and opens
nothing) wakes it at the next write; where there is no watch it looks less and less
often, down to once per ``interval``. An idle producer then costs no wake-ups here: a
process serving hundreds of them would otherwise wake 20 times a second for each.

With ``durability="full"`` the commits keep SQLite's own checkpoints: each commit waits for
an fsync already, and a checkpoint's fsyncs from another thread contend with those
(measured: 32 concurrent handlers committed 15 % fewer transfers/s with the checkpoints
beside them than in their COMMITs).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sqlite3
import time

import aiosqlite

from ...sql import Durability
from .walwatch import WalWatch

logger = logging.getLogger("streamq.producer")

# Pages of WAL after which the writer's own commit checkpoints: 16 times SQLite's default.
WRITER_AUTOCHECKPOINT = 16_000
# While idle with a watch: looks anyway this often, should a write event go missing.
IDLE_LOOK = 30.0


class Checkpointer:
    """Checkpoints ``path``'s WAL once it was written to, at most every ``interval``
    seconds, or sooner once it grew by ``grown_bytes`` (a burst of commits). Looks every
    ``tick`` seconds (one ``stat`` of the WAL file) while it is written; idle, it waits for
    the WAL's watch (the module docstring)."""

    def __init__(
        self,
        path: str,
        durability: Durability,
        *,
        tick: float = 0.05,
        interval: float = 1.0,
        grown_bytes: int = 4 * 1024 * 1024,
    ) -> None:
        self._path = path
        self._durability = durability
        self._tick, self._interval, self._grown = tick, interval, grown_bytes
        self._conn: aiosqlite.Connection | None = None
        self._watch = WalWatch(path)
        self._task: asyncio.Task[None] | None = None
        self.checkpoints = 0  # run so far
        self.last: tuple[int, int, int] | None = None  # the last one's (busy, log, copied)

    async def start(self) -> None:
        from .storage import connect  # storage.py opens the writer with this module

        self._conn = await connect(self._path)
        # Its syncs follow the writer's durability: a checkpoint fsyncs the WAL before
        # copying it and the database file after, unless synchronous is OFF.
        await self._conn.execute(f"PRAGMA synchronous={self._durability.upper()}")
        await self._watch.start()
        # The WAL as it is now counts as checkpointed; any later write does not.
        self._task = asyncio.create_task(self._run(_stat(self._path + "-wal")))

    async def _run(self, at_checkpoint: tuple[int, int]) -> None:
        wal = self._path + "-wal"
        checkpointed_at = time.monotonic()
        tick, idle = self._tick, True
        while True:
            if idle and self._watch.active:
                await self._watch.wait(IDLE_LOOK)  # the next write to the WAL wakes it
            else:
                await asyncio.sleep(tick)
            now = _stat(wal)
            if now == at_checkpoint:  # not written since
                tick, idle = min(tick * 2, self._interval), True
                continue
            tick, idle = self._tick, False
            burst = now[0] >= at_checkpoint[0] + self._grown
            if not burst and time.monotonic() - checkpointed_at < self._interval:
                continue
            at_checkpoint, checkpointed_at = now, time.monotonic()
            await self.checkpoint()

    async def checkpoint(self) -> None:
        """One passive checkpoint now (it waits for no reader and no writer)."""
        assert self._conn is not None
        try:
            rows = await self._conn.execute_fetchall("PRAGMA wal_checkpoint(PASSIVE)")
        except sqlite3.Error as exc:  # the writer's own fallback checkpoints meanwhile
            logger.warning("WAL checkpoint of %s failed: %s", self._path, exc)
            return
        self.checkpoints += 1
        for busy, log, copied in rows:
            self.last = (int(busy), int(log), int(copied))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self._watch.close()
        if self._conn is not None:
            await self._conn.close()
            self._conn = None


async def take_over(
    conn: aiosqlite.Connection, path: str, durability: Durability
) -> Checkpointer | None:
    """Take the checkpoints of the database at ``path`` out of ``conn``'s commits and start
    a ``Checkpointer`` for them, where that pays (``durability="normal"``); None if not."""
    if durability != "normal" or path == ":memory:":
        return None
    await conn.execute(f"PRAGMA wal_autocheckpoint={WRITER_AUTOCHECKPOINT}")
    checkpointer = Checkpointer(path, durability)
    await checkpointer.start()
    return checkpointer


def _stat(path: str) -> tuple[int, int]:
    """(size, modification time in ns) of the WAL file; (0, 0) while there is none."""
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return 0, 0
    return found.st_size, found.st_mtime_ns
