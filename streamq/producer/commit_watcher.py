"""Noticing what other connections and processes commit to a producer's database.

Any number of writers append to one database (workers with ``serve=False``,
``streamq.publish`` on the application's own connections); the serving producer learns
of their commits here. The storage's watch wakes it (SQLite: writes to the WAL, by
inotify; PostgreSQL: NOTIFY), with a slow periodic check as a fallback; the catch-up
itself (``Writing.check``) reads heads, lows, epochs and registrations in one hop and
hands new heads to the log, which wakes the subscribers. Requests and the producer's own
transactions catch up first, without waiting for this loop.

While nothing waits for a commit, a write looks at most once per ``IDLE_CHECK``:
a service committing back to back in this process (a ``SyncProducer``'s threads) or
beside it would otherwise pay a catch-up per commit that nobody reads. A wait that
begins ends that pause at once, and requests catch up first anyway; what it delays is
only the in-memory heads (``Producer.head``, the metrics). Not where the producer numbers
records itself (PostgreSQL): there the catch-up serves the publishers' receipts. A
fan-out counts as waiting only once it has sent its subscribers everything
(``fanout.Fanout._count_wait``): while it serves a round, and in the pause after one,
a look would only move the head again before the next round reads it. So under load
the looks follow the rounds, one each (measured beside a writer at full speed: 4,622
looks for 825 rounds before, 1,116 for 903 after, and the serving process's CPU from
9.5 to 6.8 µs an order).

While one waits, a look follows the last one after a gap that adapts to the load, as
the fan-out's rounds do (``spacing``): three times as long as the last look's queries
took, at least ``BUSY_GAP`` and at most ``MAX_BUSY_GAP``; none after a quiet spell (the
gap runs from the last look's end). Worker processes committing at full speed would otherwise
get a catch-up (a few queries, ~100 µs of the serving process's CPU) per one or two
commits. A fixed half millisecond took the serving process from 77-93 to 56-63 µs of
CPU per order at 7,000-8,000 orders/s and the consumer's p50 from 4-6 ms to about 2 ms;
a gap of 2-5 ms under load halved its CPU per order again. Looks slow down as the
machine gets busy (the queries wait for a core), so their gap widens with the load, and
at 1,000 commits/s it stays near ``BUSY_GAP``.

A look takes a fraction of a millisecond, though, so three times that kept the gap at
its floor even at full speed. The floor itself widens while commits queue
(``least_gap``): after a look that found n records committed, the next waits at least
``BUSY_GAP`` times the square root of n, so at r records a second the gap settles near
``BUSY_GAP`` squared times r (3.5 ms at 14,000/s), while at 2,000/s or less a look
finds one and the floor stays where it was: p99 at paced rates does not move. Measured
with one worker at full speed (alternating, three runs each): the serving process's CPU
26.5-34.2 -> 11.8-15.0 µs an order, the consumer's 7.8-9.4 -> 4.3-6.0; receipt p50 1.4-1.8
-> 2.7-3.1 ms. At 2,000/s paced, p99 5.5-8.3 ms against 7.8-18 before.
"""

from __future__ import annotations

import asyncio
import logging
import math

from .spacing import Spacing
from .storage import Watch
from .writing import Writing

logger = logging.getLogger("streamq.producer")

# Where no event wakes the producer (not Linux), how often it checks for other writers'
# commits; where events do, the slow check that catches a missed one.
POLL_INTERVAL = 0.05
FALLBACK_CHECK = 5.0
# After a write event that found no new commit: looks again after RECHECK, doubling
# up to RECHECK_LAST (a commit becomes visible after its WAL writes, and a slow sync
# holds it back longer).
RECHECK = 0.002
RECHECK_LAST = 0.256
IDLE_CHECK = 0.05
# While subscribers wait: the least time between looks while commits come one at a time
# (``least_gap`` widens it while they queue) and the most (``spacing``), so that commits
# coming faster share a catch-up (see the docstring).
BUSY_GAP = 0.0005
MAX_BUSY_GAP = 0.005


async def watch_commits(writing: Writing, watch: Watch, interval: float | None) -> None:
    """Notice commits made to this database by other processes and connections, for
    ever: woken by ``watch``, or every ``interval`` seconds as a fallback. The
    producer's own transactions catch up at BEGIN; the watch is for serving, so a
    producer that does not serve runs none."""
    if interval is None:
        interval = FALLBACK_CHECK if watch.active else POLL_INTERVAL
    loop = asyncio.get_running_loop()
    spacing = Spacing(BUSY_GAP, MAX_BUSY_GAP)
    while True:
        event_at = await watch.wait(interval)
        if event_at is not None and writing.numberer is None:
            if not writing.log.waits.count:
                await writing.log.waits.until_one_begins(IDLE_CHECK)  # see the docstring
            else:
                pause = spacing.pause(loop.time())
                if pause > 0:
                    await asyncio.sleep(pause)
        took, caught = spacing.took, writing.caught
        try:
            took = await _look_for_commits(writing, watch, event_at)
        except Exception:  # the database away (a server restarting): look again later
            logger.exception("checking for other writers' commits failed")
        spacing.least = least_gap(writing.caught - caught)
        spacing.done(took, loop.time())


def least_gap(found: int) -> float:
    """The least wait before the next look, after one that found ``found`` records: at
    most one, ``BUSY_GAP``; more, as the square root of them (see the docstring), up to
    ``MAX_BUSY_GAP``."""
    return min(MAX_BUSY_GAP, BUSY_GAP * math.sqrt(max(found, 1)))


async def _look_for_commits(writing: Writing, watch: Watch, event_at: float | None) -> float:
    """Catch up, looking again a while for a write not yet visible as a commit; returns
    the time the looks themselves took (the waits between them left out)."""
    loop = asyncio.get_running_loop()
    took = 0.0
    delay = RECHECK
    while True:
        began = loop.time()
        found = await writing.check()
        took += loop.time() - began
        if found or event_at is None:
            return took
        # A write not yet visible as a commit (or this producer's own): look again,
        # later each time, sooner after another write; at most one look per RECHECK.
        if delay > RECHECK_LAST:
            return took
        await asyncio.sleep(RECHECK)
        if await watch.wait(delay - RECHECK) is not None:
            delay = RECHECK
        else:
            delay *= 2
