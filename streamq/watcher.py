"""Catching up with what other connections and processes committed to a producer's database.

Any number of writers append to one database (workers with ``serve=False``,
``streamq.publish`` on the application's own connections); the serving producer learns
of their commits here. The storage's watch wakes it (SQLite: writes to the WAL, by
inotify; PostgreSQL: NOTIFY), with a slow periodic check as a fallback; requests and
the producer's own transactions catch up first. A catch-up reads heads, lows, epochs and
registrations in one hop and hands new heads to the log, which wakes the subscribers.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from .storage import Changes, Watch

if TYPE_CHECKING:
    from .producer import Producer

logger = logging.getLogger("streamq.producer")

# Where no event wakes the producer (not Linux), how often it checks for other writers'
# commits; where events do, the slow check that catches a missed one.
POLL_INTERVAL = 0.05
FALLBACK_CHECK = 1.0
# After a write event that found no new commit: looks again after RECHECK, doubling
# up to RECHECK_LAST (a commit becomes visible after its WAL writes, and a slow sync
# holds it back longer).
RECHECK = 0.002
RECHECK_LAST = 0.256


class CommitWatcher:
    """What one producer knows of its database's commits: ``version`` (the storage's
    version when it last caught up), and the catching up."""

    def __init__(self, producer: Producer) -> None:
        self._producer = producer
        self.version: Any = None

    async def run(self, watch: Watch, interval: float | None) -> None:
        """Notice commits made to this database by other processes and connections, for
        ever: woken by ``watch``, or every ``interval`` seconds as a fallback. The
        producer's own transactions catch up at BEGIN; the watch is for serving, so a
        producer that does not serve runs none."""
        if interval is None:
            interval = FALLBACK_CHECK if watch.active else POLL_INTERVAL
        while True:
            event_at = await watch.wait(interval)
            try:
                await self._look_for_commits(watch, event_at)
            except Exception:  # the database away (a server restarting): look again later
                logger.exception("checking for other writers' commits failed")

    async def _look_for_commits(self, watch: Watch, event_at: float | None) -> None:
        delay = RECHECK
        while not await self.check() and event_at is not None:
            # A write not yet visible as a commit (or this producer's own): look again,
            # later each time, sooner after another write; at most one look per RECHECK.
            if delay > RECHECK_LAST:
                break
            await asyncio.sleep(RECHECK)
            if await watch.wait(delay - RECHECK) is not None:
                delay = RECHECK
            else:
                delay *= 2

    async def before_request(self) -> None:
        """Before a request is answered: catch up, so a client that saw its commit return
        finds it served. Not while the producer's transaction holds the write lock: then
        nobody else commits, and its BEGIN caught up (a request does not wait for the
        application's work); while that BEGIN still waits for the lock, ``read_ahead``."""
        producer = self._producer
        if producer.beginning is not None:
            await self.read_ahead()
        elif not producer._in_transaction:
            await self.check()

    async def check(self, *, heads: bool | None = None) -> bool:
        """Catch up if another connection committed; True if one had. While the
        producer's BEGIN waits for another connection's write lock, ``read_ahead``."""
        producer = self._producer
        if producer.beginning is not None and not heads:
            return await self.read_ahead()
        async with producer._lock:
            version = await producer.storage.version()
            if version == self.version and not heads:
                return False
            await self.catch_up(version, heads=heads)
            return True

    async def catch_up(self, version: Any, *, heads: bool | None = None) -> None:
        """Load what other writers committed up to ``version`` (the caller holds the
        producer's lock): heads, lows, epochs, the database's epoch, registrations, read
        in one hop. Their records are served from the database; the producer's next seqs
        continue after theirs.

        Where the producer numbers records itself (PostgreSQL), heads move when a
        numbering round is served, after its flush: a catch-up takes no head from the
        database (its rounds may not be flushed yet) unless ``heads`` says so (the
        numbering, resuming after a failure, flushed first), and adds a stream it does
        not know only if no round is serving it."""
        producer = self._producer
        if heads is None:
            heads = producer.numberer is None
        changes = await producer.storage.changes(self._known())
        producer.epoch = changes.epoch
        producer._apply_registrations(changes.consumers)
        self._apply(changes, heads)
        self.version = version

    async def read_ahead(self) -> bool:
        """While the producer's BEGIN waits for another connection's write lock (SQLite),
        catch up with that connection's commits from a read connection (the writer's is
        the one waiting): streams, heads and epoch rows, forward only; True if a head
        moved. Dropped if the BEGIN went through meanwhile: then it caught up itself, and
        what was read may hold the producer's own commit, not yet in memory. The version
        stays: the BEGIN compares its own."""
        producer = self._producer
        waiting = producer.beginning
        changes = await producer.storage.changes(self._known(), reading=True)
        if waiting is None or producer.beginning is not waiting:
            return False
        return self._apply(changes, heads=True)

    def _known(self) -> dict[int, tuple[int, int]]:
        """{stream id: (head, first seq of the last epoch segment)}, as the log has them."""
        return {
            s.id: (s.head, s.epochs.last_first_seq) for s in self._producer.log.streams.values()
        }

    def _apply(self, changes: Changes, heads: bool) -> bool:
        """Hand ``changes`` to the log: new streams, epoch rows, lows and compaction, and
        (``heads``) heads that moved, which wakes their subscribers; True if one did."""
        producer = self._producer
        numberer = producer.numberer
        log = producer.log
        moved = False
        new_epochs: dict[int, list[tuple[int, int]]] = {}
        for stream_id, first_seq, epoch in changes.epoch_rows:
            new_epochs.setdefault(stream_id, []).append((first_seq, epoch))
        for row in changes.streams:
            stream = log.streams.get(row.name)
            if stream is None:
                if numberer is not None and row.name in numberer.unserved:
                    continue
                stream = log.add(row)
            # Their epoch rows first: subscribers woken next send epochs.
            for first_seq, epoch in new_epochs.get(row.id, ()):
                stream.epochs.add(first_seq, epoch)
            stream.low = max(stream.low, row.low)
            stream.max_ts = row.max_ts
            if row.compacted > stream.compacted:  # its tail may hold removed records
                stream.compacted = row.compacted
                stream.tail.reset(stream.head + 1)
                producer.retention.forget(stream.name)
            if heads and row.head > stream.head:
                log.committed(stream, row.head, None)
                moved = True
        return moved
