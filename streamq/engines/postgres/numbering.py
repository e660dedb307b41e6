"""Numbering what writers published on PostgreSQL: the serving producer's side of
``append.py``'s publish path.

Writers insert records unnumbered into ``streamq_pending`` and take no lock; the
serving producer numbers what committed, one *round* at a time: a transaction of its
own deletes the pending rows its snapshot sees (whole transactions, those of the first
``LIMIT`` rows in (xid, id) order), gives each stream's rows the seqs after its head, in
that order, and inserts them into ``streamq_log`` with their time-index and epoch rows.
A second numberer (there should be none: it runs in the process holding the serving
lock) would fail on the log's primary key and roll back, losing nothing.

Rounds commit without waiting for their WAL flush (``synchronous_commit=off``), so that
they ride on the writers' flushes instead of adding one of their own between them; a
round's records are served only once the WAL is flushed past its commit, so a consumer
never sees a seq that a crash could give to another record. When no writer flushes
soon (``FLUSH_PATIENCE_MS``), the numberer flushes itself.

Between rounds it waits inside the server (``streamq_wait``) while records keep coming,
and on ``NOTIFY`` once idle for ``ACTIVE_MS`` (the doorbell: ``append.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ...errors import DatabaseOpenError
from ...producer.append_rule import append_rows, check_last_seq, segment_row
from ...producer.storage import (
    EpochRow,
    Group,
    LogRow,
    Numbered,
    NumberedStream,
    OpenTransactions,
    StreamSettings,
    TimeRow,
)
from ...protocol import numbered
from .append import (
    CHANNEL,
    COMMITTED,
    DOORBELL,
    Statement,
    Steps,
    insert_statement,
    new_epoch_steps,
    run,
    run_async,
)
from .driver import connect_async, psycopg_module

logger = logging.getLogger("streamq.postgres")

# A round takes the transactions of the first LIMIT pending rows, each whole: a round
# that cut one could see an older transaction commit before the next, and put its
# records between the two parts of the one it cut.
LIMIT = 10_000
NAP_MS = 1.0  # between looks for pending records, inside the server
ACTIVE_MS = 100  # looking that long finding nothing: idle, arm the doorbell
FLUSH_PATIENCE_MS = 3  # a round's flush left to the writers that long at most
IDLE_CHECK = 5.0  # seconds: armed, a round anyway after this long (no wake can be lost)
# A transaction that published and stays open keeps the doorbell from being armed: the
# numberer waits for records inside the server instead, up to a second at a time (a
# round trip and a round each), looking every 20 ms.
BLOCKED_WAIT_MS, BLOCKED_NAP_MS = 1000, 20.0
OPEN_LOOK_S = 1.0  # how often open publishing transactions are looked up
_RECONNECT_DELAY = 1.0

# The committed pending rows this round's snapshot sees, the transactions of the first
# LIMIT in numbering order, whole, among those the window names (``Window``):
# (xid, id, stream, timestamp, unnumbered record, key); with each, the database's epoch
# and whether this server life took one (append.py, epochs), computed once. Of the
# window's open transactions, only those committed are looked up: one open for an hour
# and its rows are not read again each round.
TAKE = f"""
DELETE FROM streamq_pending WHERE xid = ANY(ARRAY(
    SELECT xid FROM (
        (SELECT xid, id FROM streamq_pending
         WHERE xid = ANY({COMMITTED.format(open="%(open)s::text[]::xid8[]")})
         ORDER BY xid, id LIMIT %(limit)s)
        UNION ALL
        (SELECT xid, id FROM streamq_pending WHERE xid > %(frontier)s::text::xid8
         ORDER BY xid, id LIMIT %(limit)s)) AS candidates
    ORDER BY xid, id LIMIT %(limit)s))
RETURNING xid::text::bigint, id, stream, ts, record, key,
    (SELECT value FROM streamq_meta WHERE key = 'epoch'),
    (SELECT EXISTS (SELECT FROM streamq_boot))"""
# Taken before a round's TAKE (its snapshot is older): the next round's window.
SNAPSHOT = """
SELECT pg_snapshot_xmax(s)::text::bigint, ARRAY(SELECT pg_snapshot_xip(s)::text::bigint)
FROM pg_current_snapshot() AS s"""
# The streams named, as found: their head, largest timestamp, last segment's epoch.
STATE = """
SELECT s.name, s.id, s.low, s.key_index, s.compact, s.notify_compacted,
    greatest(s.low - 1, coalesce((SELECT max(seq) FROM streamq_log WHERE stream_id = s.id), 0)),
    (SELECT max(ts) FROM streamq_time WHERE stream_id = s.id),
    (SELECT epoch FROM streamq_epochs WHERE stream_id = s.id ORDER BY first_seq DESC LIMIT 1)
FROM streamq_streams AS s WHERE s.name = ANY(%s)"""
CREATE_STREAMS = (
    "INSERT INTO streamq_streams (name) SELECT unnest(%s::text[]) ON CONFLICT (name) DO NOTHING"
)
WAIT = (
    "SELECT pending, (target - '0/0')::bigint, (flushed - '0/0')::bigint "
    "FROM streamq_wait(%(flush)s, %(timeout_ms)s, %(nap_ms)s, %(frontier)s::text::xid8, "
    "%(open)s::text[]::xid8[])"
)
# Transactions of this database that published and have not ended (they hold their
# INSERT's lock on the pending table), other than the numberer's own: how many, and
# when the oldest began.
OPEN_TRANSACTIONS = """
SELECT count(*), extract(epoch FROM min(a.xact_start))::float8
FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid
WHERE l.locktype = 'relation' AND l.relation = 'streamq_pending'::regclass
    AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
    AND l.mode = 'RowExclusiveLock' AND l.pid <> pg_backend_pid()"""
# A transaction that writes WAL and commits synchronously: flushes all WAL before it.
FLUSH = (
    "BEGIN; SET LOCAL synchronous_commit = on; "
    "SELECT pg_logical_emit_message(true, 'streamq.flush', ''); COMMIT"
)


@dataclass(frozen=True, slots=True)
class Window:
    """Where pending rows can still be, as rounds left them: transactions above
    ``frontier``, and the ``open`` ones below it (in progress at a snapshot).

    Rows a round took stay in the table's index, dead, until vacuum removes them, and
    vacuum cannot while any snapshot older than them is held (a long transaction, a
    report, ``pg_dump``): a round that read the index from its start would walk them all
    again, a little longer each round. Looking only in the window skips them.

    Why nothing is missed: let S be any snapshot taken before a round's TAKE. A row the
    round cannot see belongs to a transaction in progress at S (in S's xip), one begun
    after S (xid at least S's xmax), or one that aborted. A row it can see but left
    behind (the LIMIT) has an xid above the last it took. So the next window is: above
    min(xmax - 1, last xid taken if the LIMIT may have cut), and S's xip below that.
    """

    frontier: int = 0
    open: tuple[int, ...] = ()

    @classmethod
    def after(cls, snapshot: tuple[int, list[int]], done: Numbered | None, limit: int) -> Window:
        """The window after a round that took ``done`` (None: nothing), given a
        snapshot's (xmax, xip) taken before its TAKE."""
        xmax, xip = snapshot
        frontier = xmax - 1
        if done is not None and sum(len(s.records) for s in done.streams) >= limit:
            frontier = min(frontier, max(g.xid for s in done.streams for g in s.groups))
        return cls(frontier, tuple(x for x in xip if x <= frontier))

    def params(self, limit: int) -> dict[str, Any]:
        """TAKE's parameters."""
        return self._bounds() | {"limit": limit}

    def wait(self, flush: bool, timeout_ms: float, nap_ms: float) -> dict[str, Any]:
        """WAIT's parameters."""
        return self._bounds() | {"flush": flush, "timeout_ms": timeout_ms, "nap_ms": nap_ms}

    def _bounds(self) -> dict[str, Any]:
        return {"open": [str(x) for x in self.open], "frontier": str(self.frontier)}


EVERYWHERE = Window()


@dataclass(frozen=True, slots=True)
class StreamState:
    """A stream as numbering left it. The numberer keeps them between rounds (it alone
    appends to the log); a round that finds another appended meanwhile fails on the
    log's primary key, and the numberer reads them again."""

    id: int
    low: int
    settings: StreamSettings
    head: int
    max_ts: int | None
    last_epoch: int | None


def states_after(done: Numbered) -> dict[str, StreamState]:
    """The streams as a round leaves them."""
    return {
        s.name: StreamState(s.id, s.low, s.settings, s.head, s.max_ts, done.epoch)
        for s in done.streams
    }


def number_steps(
    limit: int = LIMIT,
    known: dict[str, StreamState] | None = None,
    before_commit: Callable[[Numbered], None] | None = None,
    window: Window = EVERYWHERE,
) -> Steps:
    """One round, in the caller's transaction: a ``Numbered``, or None if nothing was
    pending (in ``window``). Streams not in ``known`` are read (and created if new);
    ``before_commit`` is told what it numbered before the caller commits."""
    rows = yield Statement(TAKE, window.params(limit), fetch_all=True)
    if not rows:
        return None
    rows.sort(key=lambda row: (row[0], row[1]))  # RETURNING keeps no order
    epoch, booted = int(rows[0][6]), rows[0][7]
    return (yield from number_rows(rows, epoch, booted, known, before_commit))


def number_rows(
    rows: list[Any],
    epoch: int,
    booted: bool,
    known: dict[str, StreamState] | None = None,
    before_commit: Callable[[Numbered], None] | None = None,
    also: Statement | None = None,
) -> Steps:
    """Number ``rows`` (``(xid, id, stream, ts, unnumbered record, key)``, in the order
    their seqs follow) and insert them into the log, in the caller's transaction: a
    ``Numbered``. ``epoch`` is the database's, ``booted`` whether this server life took
    one (else a new one is taken); ``also`` is run in the insert's statement; the rest
    as ``number_steps``."""
    names = list(dict.fromkeys(row[2] for row in rows))
    states = {name: known[name] for name in names if known and name in known}
    unknown = [name for name in names if name not in states]
    if unknown:
        states |= yield from _read_states(unknown)
    if not booted:
        # The first numbering since the server started after a crash, or was promoted.
        epoch = yield from new_epoch_steps(if_not_booted=True)
    result = Numbered(epoch, [])
    log_rows: list[LogRow] = []
    times: list[TimeRow] = []
    epochs: list[EpochRow] = []
    by_stream: dict[str, list[Any]] = {name: [] for name in names}
    for row in rows:
        by_stream[row[2]].append(row)
    for name, taken in by_stream.items():
        state = states[name]
        sid, first = state.id, state.head + 1
        check_last_seq(name, first + len(taken) - 1)
        segment = segment_row(sid, first, state.last_epoch, epoch)
        stream = NumberedStream(
            sid, name, state.low, state.settings, first, [], state.max_ts, segment is not None
        )
        records, groups, seq = stream.records, stream.groups, first
        for xid, pending_id, _, _, record, *_ in taken:
            records.append(numbered(bytes(record), seq))
            if groups and groups[-1].xid == xid:
                groups[-1].ids.append(pending_id)
            else:
                groups.append(Group(xid, [pending_id], seq))
            seq += 1
        stream.max_ts = append_rows(
            log_rows,
            times,
            sid,
            first,
            state.max_ts,
            state.settings.key_index,
            records,
            [row[3] for row in taken],
            [None if row[5] is None else bytes(row[5]) for row in taken],
        )
        if segment is not None:
            epochs.append(segment)
        result.streams.append(stream)
    yield insert_statement(log_rows, times, epochs, also)
    if before_commit is not None:
        before_commit(result)
    return result


def _read_states(names: list[str]) -> Steps:
    """The streams named, as committed, creating those that do not exist."""
    found = yield Statement(STATE, (names,), fetch_all=True)
    missing = set(names) - {row[0] for row in found}
    if missing:
        yield Statement(CREATE_STREAMS, (sorted(missing),))
        found += yield Statement(STATE, (sorted(missing),), fetch_all=True)
    return {
        name: StreamState(
            sid, low, StreamSettings(key_index, compact, notify), int(head), max_ts, last_epoch
        )
        for name, sid, low, key_index, compact, notify, head, max_ts, last_epoch in found
    }


def number_all(conn: Any) -> int:
    """Number everything pending, on a psycopg ``Connection`` (autocommit), with nothing
    served: for tools and tests with no serving producer. The records numbered."""
    total = 0
    while True:
        with conn.transaction():
            done = run(conn, number_steps())
        if done is None:
            return total
        total += sum(len(s.records) for s in done.streams)


@dataclass(slots=True)
class _Unflushed:
    numbered: Numbered
    at: float = field(default_factory=time.monotonic)  # committed (or about to be)
    bound: int | None = None  # the WAL position its commit ends before, once known


class Numberer:
    """The serving producer's numbering loop, on a connection of its own. ``serve`` is
    given each round once its WAL is flushed, in order; ``unserved`` names the streams
    of rounds committed (or about to be) and not served yet."""

    def __init__(
        self,
        url: str,
        where: str,
        serve: Callable[[Numbered], None],
        resync: Callable[[], Awaitable[Any]],
    ) -> None:
        self._url, self._where = url, where
        self._serve = serve
        # After a failure, rounds may have committed unserved: once reconnected and
        # flushed, the producer takes heads (and epoch rows) from the database.
        self._resync = resync
        self._lost = False
        self.idle_check = IDLE_CHECK  # armed, a round anyway after this long (seconds)
        self.armed = False  # waiting for the doorbell
        self._conn: Any = None
        self._unflushed: deque[_Unflushed] = deque()
        self._known: dict[str, StreamState] = {}  # streams as the last rounds left them
        self._window = EVERYWHERE  # where pending rows can be, as the last round left them
        self._flushed = 0  # the WAL flushed up to here, as last seen
        self._flush_moved_at = 0.0  # when it was seen to move last
        self.unserved: Counter[str] = Counter()
        self.rounds = 0
        self.open_transactions = OpenTransactions()
        self._looked_at = -OPEN_LOOK_S  # monotonic time of the last look
        self._blocked = False  # the doorbell could not be armed: an open transaction

    async def run(self) -> None:
        """For ever: a lost connection (the server restarting) is made again, a second
        apart at most; a round that failed is rolled back, its rows still pending."""
        while True:
            try:
                if self._conn is None or self._conn.closed or self._conn.broken:
                    await self._connect()
                if self._lost:
                    await self._recover()
                    self._lost = False
                await self._turn()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not isinstance(exc, DatabaseOpenError | psycopg_module().OperationalError):
                    logger.exception("numbering records on %s failed", self._where)
                else:
                    logger.warning("numbering on %s: %s; connecting again", self._where, exc)
                self._lost = True
                await self._reset()
                await asyncio.sleep(_RECONNECT_DELAY)

    async def _connect(self) -> None:
        self._conn = await connect_async(
            self._url, self._where, application_name="streamq numbering"
        )
        await self._conn.execute("SET synchronous_commit = off")
        await self._conn.execute(f"LISTEN {CHANNEL}")

    async def _reset(self) -> None:
        """After a failure: the connection goes; rounds not known to be flushed wait for
        ``_recover``."""
        self._known.clear()
        self._window = EVERYWHERE
        if self._conn is not None:
            with contextlib.suppress(Exception):
                await self._conn.close()
        self._conn = None

    async def _turn(self) -> None:
        """A round; then, if it found nothing, wait: for more records, for the flush of
        what is numbered, or (idle) for the doorbell."""
        if time.monotonic() - self._looked_at >= OPEN_LOOK_S:
            await self._look()
        if await self._round():
            self._blocked = False
            # Writers committing without waiting for their flush (synchronous_commit off)
            # leave it to the WAL writer, every 200 ms: once a round has waited, and no
            # flush was seen meanwhile, flush.
            patience, now = FLUSH_PATIENCE_MS / 1000, time.monotonic()
            waited = self._unflushed and now - self._unflushed[0].at > patience
            if waited and now - self._flush_moved_at > patience:
                await self._flush()
            return
        if self._unflushed:
            if not await self._wait(FLUSH_PATIENCE_MS) and self._unflushed:
                await self._flush()
            return
        if self._blocked:
            if not await self._wait(BLOCKED_WAIT_MS, BLOCKED_NAP_MS):
                await self._sleep()
        elif not await self._wait(ACTIVE_MS):
            await self._sleep()

    async def _round(self) -> bool:
        """Number what is pending, in two round trips: BEGIN and the rows taken; the
        records, COMMIT and a wait for their flush (or for more records). True if it
        numbered anything."""
        conn = self._conn
        try:
            async with conn.pipeline():
                await conn.execute("BEGIN")
                snapshot = await conn.execute(SNAPSHOT)  # read with TAKE's rows
                steps = number_steps(LIMIT, self._known, self._taken, self._window)
                done: Numbered | None = await run_async(conn, steps)
                window = Window.after(await snapshot.fetchone(), done, LIMIT)
                if done is None:
                    await conn.execute("ROLLBACK")
                    self._window = window
                    return False
                self._unflushed.append(_Unflushed(done))  # committed or not: _recover
                await conn.execute("COMMIT")
                waited = await conn.execute(WAIT, window.wait(True, FLUSH_PATIENCE_MS, NAP_MS))
        except BaseException:
            # Heads may have moved under another numberer; rows may be pending again.
            self._known.clear()
            self._window = EVERYWHERE
            with contextlib.suppress(Exception):
                await conn.execute("ROLLBACK")
            raise
        self._known |= states_after(done)
        self._window = window
        self.rounds += 1
        self._waited(await waited.fetchone())
        return True

    async def _recover(self) -> None:
        """Once connected again after a failure: flush what committed, have the producer
        take heads (and epoch rows) from the database, then serve the rounds that did
        commit (those waiting for their receipts learn their seqs); a round whose commit
        was lost left its rows pending, to be numbered again."""
        await self._conn.execute(FLUSH)
        await self._resync()
        while self._unflushed:
            done = self._unflushed.popleft().numbered
            if await self._committed(done):
                self._served(done)
            else:
                self._forget(done)

    async def _committed(self, done: Numbered) -> bool:
        for stream in done.streams:
            cursor = await self._conn.execute(
                "SELECT record FROM streamq_log WHERE stream_id = %s AND seq = %s",
                (stream.id, stream.first),
            )
            row = await cursor.fetchone()
            if row is None or bytes(row[0]) != stream.records[0]:
                return False
        return True

    def _taken(self, done: Numbered) -> None:
        for stream in done.streams:
            self.unserved[stream.name] += 1

    async def _look(self) -> None:
        cursor = await self._conn.execute(OPEN_TRANSACTIONS)
        count, oldest = await cursor.fetchone()
        self.open_transactions = OpenTransactions(int(count), oldest)
        self._looked_at = time.monotonic()

    async def _wait(self, timeout_ms: float, nap_ms: float = NAP_MS) -> bool:
        """``streamq_wait``; True if records are pending. Serves what is flushed."""
        params = self._window.wait(bool(self._unflushed), timeout_ms, nap_ms)
        cursor = await self._conn.execute(WAIT, params)
        return self._waited(await cursor.fetchone())

    def _waited(self, row: tuple[bool, int | None, int]) -> bool:
        """What ``streamq_wait`` returned: serve the rounds the flush covers."""
        pending, target, flushed = row
        if flushed > self._flushed:  # someone flushed: what is unflushed will be soon
            self._flushed, self._flush_moved_at = flushed, time.monotonic()
        for item in self._unflushed:
            if item.bound is None:
                item.bound = target
        while self._unflushed:
            bound = self._unflushed[0].bound
            if bound is None or flushed < bound:
                break
            self._served(self._unflushed.popleft().numbered)
        return bool(pending)

    async def _flush(self) -> None:
        await self._conn.execute(FLUSH)
        while self._unflushed:
            self._served(self._unflushed.popleft().numbered)

    def _served(self, done: Numbered) -> None:
        try:
            self._serve(done)
        finally:
            self._forget(done)

    def _forget(self, done: Numbered) -> None:
        """``done`` is served, or was never committed: its streams are no more unserved."""
        for stream in done.streams:
            self.unserved[stream.name] -= 1
            if not self.unserved[stream.name]:
                del self.unserved[stream.name]

    async def _sleep(self) -> None:
        """Arm the doorbell (if no publishing transaction holds it), look once more, and
        wait for a ring; disarm."""
        conn = self._conn
        async for _ in conn.notifies(timeout=0):  # rings of the active spell: heard
            pass
        cursor = await conn.execute(f"SELECT pg_try_advisory_lock({DOORBELL})")
        (armed,) = await cursor.fetchone()
        self._blocked = not armed
        if not armed:
            return  # a transaction is publishing: look again
        try:
            if not await self._wait(0):
                self.armed = True
                async for _ in conn.notifies(timeout=self.idle_check, stop_after=1):
                    pass
        finally:
            self.armed = False
            await conn.execute(f"SELECT pg_advisory_unlock({DOORBELL})")

    async def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                await self._conn.close()
            self._conn = None
