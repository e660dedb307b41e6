"""PostgreSQL failover and server crashes, on real servers (``tests/pgserver.py``). What
must hold: the records a crash or a failover loses are never replaced silently. Their seqs
are numbered again, densely from the surviving head, under a higher epoch
(``streamq_epochs``), so a consumer that remembers the (epoch, seq) it read up to can tell
its records are gone (``streamq/engines/postgres/numbering.py``; docs/protocol.md,
"Epochs").

Writers insert records unnumbered (``streamq_pending``); a *numbering round* gives them
their seqs once committed. With no serving producer here, ``number`` runs the rounds
(``numbering.number_all``); reading ``streamq_log`` right after one is what a reader of
the table sees. A serving producer serves a round only once its WAL is flushed, so through
it a consumer never sees what a crash of the server loses (as
``test_a_consumer_is_served_only_what_a_crash_with_asynchronous_commits_keeps`` checks); a
failover to a replica that lagged can still lose served records.

Each test has servers of its own, since it kills them. Two tests are the cases that
once reused an epoch: a failover after the old primary took an epoch the replica never
received (epochs are at least the WAL timeline << 42), and a second crash losing an
epoch taken with synchronous_commit=off (the round that takes a new epoch commits
synchronously).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import streamq
from streamq.engines.postgres.numbering import number_all
from streamq.protocol import decode_record

from ..conftest import wait_for
from ..pgserver import PostgresMissingError, PostgresServer, find_bindir

ORDERS = "orders"
# Crash tests: a commit with synchronous_commit=off (writers on the ASYNC_COMMIT servers;
# numbering rounds, which the serving producer always commits so) returns before its WAL
# is written, and the WAL writer writes the last, partial WAL page only every
# wal_writer_delay (200 ms by default). 10 s: a kill right after the last commit loses
# the commits on that page whatever the machine's speed, instead of most of the time.
# Autovacuum off: its commits flush the WAL (synchronously) and would save the records a
# test means to lose, when a loaded machine lets it run in between.
DELAYED_WAL = {"wal_writer_delay": "10s", "autovacuum": "off"}
ASYNC_COMMIT = {"synchronous_commit": "off", **DELAYED_WAL}
# A connection's own setting, whatever the server's (a writer or a numbering round).
SYNC = {"synchronous_commit": "on"}
ASYNC = {"synchronous_commit": "off"}  # as the serving producer's rounds always commit


class Servers:
    """The servers of one test, each stopped and removed at its end."""

    def __init__(self) -> None:
        self.bindir = find_bindir()
        self.started: list[PostgresServer] = []

    def start(self, **settings: str) -> PostgresServer:
        """A new server, with the streamq tables in its ``postgres`` database, made
        durable whatever ``settings`` say (as a migration's commit would be)."""
        server = PostgresServer(self.bindir, settings)
        self.started.append(server)
        server.start()
        with psycopg.connect(server.url(), options="-c synchronous_commit=on") as conn:
            streamq.create_tables(conn)
        return server

    def replica(self, primary: PostgresServer, **settings: str) -> PostgresServer:
        replica = primary.replica(settings or None)
        self.started.append(replica)
        return replica

    def stop_all(self) -> None:
        """Stop every server, whatever one of them raises; then raise the first error."""
        errors: list[Exception] = []
        for server in reversed(self.started):
            try:
                server.stop()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]


@pytest.fixture
def servers() -> Iterator[Servers]:
    """Servers this test may crash. Missing binaries fail the test, with how to install
    them: never a skip (as the ``postgres`` fixture)."""
    try:
        group = Servers()
    except PostgresMissingError as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        yield group
    finally:
        group.stop_all()


def options(settings: dict[str, str]) -> str:
    return " ".join(f"-c {name}={value}" for name, value in settings.items())


def publish(url: str, values: Iterable[bytes], **settings: str) -> list[streamq.Receipt]:
    """Publish each value in a transaction of its own, committed (on a connection with
    ``settings``); their receipts. The records wait unnumbered in streamq_pending."""
    receipts = []
    with psycopg.connect(url, options=options(settings)) as conn:
        for value in values:
            receipt = streamq.publish(conn, ORDERS, value)
            assert isinstance(receipt, streamq.Receipt)
            receipts.append(receipt)
            conn.commit()
    return receipts


def number(url: str, **settings: str) -> int:
    """Number every pending record, in rounds as the serving producer's, serving nothing
    (``number_all``), on a connection with ``settings``: how many it numbered."""
    with psycopg.connect(url, autocommit=True, options=options(settings)) as conn:
        return number_all(conn)


def seqs_of(url: str, values: Iterable[bytes]) -> list[int]:
    """The seqs ``values`` got in "orders" (each value published there once)."""
    records = log(url)
    seqs = {value: seq for seq, value in records}
    assert len(seqs) == len(records), "a value published twice: seqs_of cannot tell"
    return [seqs[value] for value in values]


def publish_numbered(url: str, values: list[bytes]) -> list[int]:
    """``publish`` then ``number``, with nothing else pending: the seqs they got."""
    publish(url, values)
    assert number(url) == len(values)
    return seqs_of(url, values)


def pending(url: str) -> list[bytes]:
    """The values of the unnumbered records of "orders", in numbering order."""
    rows = query(
        url, "SELECT record FROM streamq_pending WHERE stream = %s ORDER BY xid, id", (ORDERS,)
    )
    return [decode_record(record).value for (record,) in rows]


def query(url: str, sql: str, params: tuple[object, ...] = ()) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(sql, params).fetchall()


def log(url: str) -> list[tuple[int, bytes]]:
    """(seq, value) of every record of "orders", in seq order."""
    rows = query(
        url,
        "SELECT l.seq, l.record FROM streamq_log l JOIN streamq_streams s ON s.id = l.stream_id "
        "WHERE s.name = %s ORDER BY l.seq",
        (ORDERS,),
    )
    return [(seq, decode_record(record).value) for seq, record in rows]


def epochs(url: str) -> list[tuple[int, int]]:
    """The segments of "orders": (first_seq, epoch) rows, in seq order."""
    rows = query(
        url,
        "SELECT e.first_seq, e.epoch FROM streamq_epochs e "
        "JOIN streamq_streams s ON s.id = e.stream_id WHERE s.name = %s ORDER BY 1",
        (ORDERS,),
    )
    return [(int(first), int(epoch)) for first, epoch in rows]


def epoch_of(segments: list[tuple[int, int]], seq: int) -> int:
    """The epoch that wrote ``seq``: its segment's."""
    return max((first, epoch) for first, epoch in segments if first <= seq)[1]


def rewritten_from(segments: list[tuple[int, int]], seen_epoch: int) -> int:
    """Where a consumer that read up to some seq under ``seen_epoch`` would be told the
    log was written again (``SUBSCRIBED.rewritten_from``): the first seq of the segments
    written by a higher epoch (epochs never decrease along a stream); 0 if none."""
    return min((first for first, epoch in segments if epoch > seen_epoch), default=0)


class EpochReusedError(AssertionError):
    """Seqs a reader saw were written again under an epoch no higher than the one it
    saw them under: the loss is silent. The expected failures expect this one only."""


def check_new_epoch(new_epoch: int, seen_epoch: int) -> None:
    if new_epoch <= seen_epoch:
        raise EpochReusedError(
            f"seqs written again under epoch {new_epoch}, after a reader saw them under "
            f"epoch {seen_epoch}: it cannot tell they changed"
        )


def boot_rows(url: str) -> int:
    """Rows of the unlogged streamq_boot: 0 until this server life takes an epoch (its
    first numbering round, or a producer's start; a writer takes none). Unreadable on a
    standby: unlogged tables cannot be read during recovery."""
    ((count,),) = query(url, "SELECT count(*) FROM streamq_boot")
    return int(count)


def values(first: int, last: int, prefix: str = "record") -> list[bytes]:
    return [f"{prefix} {n}".encode() for n in range(first, last + 1)]


N, M = 5, 9  # records the replica replays; records only the old primary has (N+1..M)


def test_a_promoted_replica_numbers_the_lost_seqs_again_under_a_higher_epoch(
    servers: Servers,
) -> None:
    """Asynchronous replication: the replica misses the primary's last numbering rounds,
    and the failover loses them (a serving producer may have served them: they were
    flushed on the primary). The promoted replica goes on from its own head, N, so seqs
    N+1..M are written again, to other records: under a higher epoch, because the
    unlogged streamq_boot is empty on a promoted replica, so its first numbering round
    takes one."""
    primary = servers.start()
    publish(primary.url(), values(1, 2))
    assert boot_rows(primary.url()) == 0  # writers take no epoch
    assert number(primary.url()) == 2
    assert seqs_of(primary.url(), values(1, 2)) == [1, 2]
    assert boot_rows(primary.url()) == 1  # the first round of this server life took it
    replica = servers.replica(primary)  # copies streamq_boot? (no: unlogged)
    assert publish_numbered(primary.url(), values(3, N)) == list(range(3, N + 1))
    replica.wait_replayed(primary)
    assert log(replica.url()) == list(enumerate(values(1, N), 1))  # copied, then streamed
    replica.crash()
    assert publish_numbered(primary.url(), values(N + 1, M)) == list(range(N + 1, M + 1))
    old_segments = epochs(primary.url())
    seen_epoch = epoch_of(old_segments, M)  # what a consumer that read up to M remembers
    primary.crash()  # the replica never received N+1..M

    replica.restart()
    replica.promote()
    url = replica.url()
    assert log(url) == list(enumerate(values(1, N), 1))  # the head is N
    assert pending(url) == []
    assert epochs(url) == [s for s in old_segments if s[0] <= N]
    assert boot_rows(url) == 0  # unlogged: neither the base backup nor the WAL has it
    publish(url, [b"after the failover"])
    assert boot_rows(url) == 0  # the writer took no epoch
    assert number(url) == 1
    assert seqs_of(url, [b"after the failover"]) == [N + 1]
    assert boot_rows(url) == 1  # this server life's first round took its epoch
    new_segments = epochs(url)
    new_epoch = epoch_of(new_segments, N + 1)
    check_new_epoch(new_epoch, max(epoch for _, epoch in old_segments))
    assert new_segments == [*[s for s in old_segments if s[0] <= N], (N + 1, new_epoch)]
    # The consumer at (seen_epoch, M) is told seqs N+1.. were written again: not silent.
    assert rewritten_from(new_segments, seen_epoch) == N + 1
    assert rewritten_from(old_segments, seen_epoch) == 0  # (on the old primary: nothing)
    ((seqs, low, head),) = query(url, "SELECT count(*), min(seq), max(seq) FROM streamq_log")
    assert (seqs, low, head) == (N + 1, 1, N + 1)


def test_failover_after_a_new_epoch_the_replica_never_received(servers: Servers) -> None:
    """The primary crashes and restarts (synchronous_commit=on, nothing lost): its first
    numbering round takes a new epoch for N+1..M. The asynchronous replica had stopped
    before and never receives them; promoted, it is on a new WAL timeline, and the epoch
    its first round takes is above every epoch of the old one's: a consumer that read
    N+1..M is told they were written again."""
    primary = servers.start()
    replica = servers.replica(primary)
    assert publish_numbered(primary.url(), values(1, N)) == list(range(1, N + 1))
    replica.wait_replayed(primary)
    replica.crash()
    primary.crash()
    primary.restart()  # crash recovery: streamq_boot emptied
    publish(primary.url(), values(N + 1, M))
    assert boot_rows(primary.url()) == 0  # the writers took no epoch: the round does
    assert number(primary.url()) == M - N
    assert seqs_of(primary.url(), values(N + 1, M)) == list(range(N + 1, M + 1))
    old_segments = epochs(primary.url())
    assert [first for first, _ in old_segments] == [1, N + 1]  # the crash: a new epoch
    assert old_segments[0][1] < old_segments[1][1]
    seen_epoch = epoch_of(old_segments, M)
    primary.crash()

    replica.restart()
    replica.promote()
    assert publish_numbered(replica.url(), [b"after the failover"]) == [N + 1]
    new_segments = epochs(replica.url())
    check_new_epoch(epoch_of(new_segments, N + 1), seen_epoch)  # counters alone: both equal
    assert rewritten_from(new_segments, seen_epoch) == N + 1


async def apply_all(
    address: str, db: str, count: int, received: list[tuple[int, bytes]] | None = None
) -> list[tuple[int, bytes]]:
    """Apply "orders" as the consumer "ledger" (its position in ``db``) until it has
    applied up to ``count``: the (seq, value) of each record this call was served, added
    to ``received`` as they come (a caller that cancels it knows them all)."""
    received = [] if received is None else received
    async with streamq.Consumer(address, ORDERS, db=db, name="ledger") as consumer:
        async with asyncio.timeout(20):
            while consumer.applied < count:
                batch = await anext(consumer)
                received += [(record.seq, record.value) for record in batch]
                async with consumer.transaction(batch):
                    pass
    return received


async def test_a_crash_with_asynchronous_commits_numbers_again_from_the_surviving_head(
    servers: Servers, figures: Callable[[str], None], tmp_path: Path
) -> None:
    """synchronous_commit=off: a commit returns (and readers of the table see it) before
    its WAL is written, so SIGKILL loses the last ones: writers' commits (their records
    are gone) and numbering rounds (their records, if their writers' commits survived,
    are pending again). Whatever survived, the seqs go on densely from the surviving
    head, under an epoch above every epoch a reader saw before; a consumer, served only
    what is flushed, lost nothing it received."""
    server = servers.start(**ASYNC_COMMIT)
    url = server.url()
    ledger = str(tmp_path / "ledger.db")
    published = values(1, 100)

    # 1..50 through a serving producer: numbered, flushed, served, applied.
    async with streamq.Producer(url) as producer:
        receipts = await asyncio.to_thread(publish, url, published[:50])
        served = [await producer.wait_served(r, timeout=20) for r in receipts]
        assert served == [range(seq, seq + 1) for seq in range(1, 51)]
        received = await apply_all(producer.address, ledger, 50)
    assert received == list(enumerate(published[:50], 1))
    # 51..100 numbered by a round no producer serves: its writers' commits are
    # synchronous for 51..80 (they survive, pending) and not for 81..100.
    publish(url, published[50:80], **SYNC)
    publish(url, published[80:])
    assert number(url) == 50
    seen = log(url)  # what a reader of the table sees before the crash: all 100
    assert seen == list(enumerate(published, 1))
    seen_segments = epochs(url)
    server.kill()
    server.restart()

    survived = log(url)
    head = len(survived)
    again = pending(url)  # committed, their numbering lost: numbered again below
    figures(
        f"published {len(published)} records, {head} numbered and {len(again)} pending "
        "survived SIGKILL"
    )
    assert head < len(seen), "no numbering round lost: the crash tested nothing"
    assert head >= len(received), "a record a consumer received was lost"
    assert survived == seen[:head]  # a prefix: commit order is seq order
    assert again == published[head : head + len(again)]  # in order, none twice
    assert len(again) >= 80 - head  # every synchronous commit's record
    assert epochs(url) == seen_segments  # the segment rows of survivors survive with them
    assert boot_rows(url) == 0  # crash recovery reset the unlogged table
    publish(url, [b"after the crash"])
    assert boot_rows(url) == 0  # the writer took no epoch: the round does
    assert number(url) == len(again) + 1
    assert boot_rows(url) == 1
    kept = [*published[: head + len(again)], b"after the crash"]
    assert log(url) == list(enumerate(kept, 1))  # dense, no gap, none twice
    ((count, low, high),) = query(url, "SELECT count(*), min(seq), max(seq) FROM streamq_log")
    assert (count, low, high) == (len(kept), 1, len(kept))
    new_epoch = epoch_of(epochs(url), head + 1)
    seen_epoch = max(epoch for _, epoch in seen_segments)
    check_new_epoch(new_epoch, seen_epoch)
    assert epochs(url) == [*seen_segments, (head + 1, new_epoch)]
    assert rewritten_from(epochs(url), seen_epoch) == head + 1  # a reader at 100 is told
    # The consumer's records were not written again: it goes on from 51, told nothing.
    async with streamq.Producer(url) as producer:
        rest = await apply_all(producer.address, ledger, len(kept))
    assert rest == list(enumerate(kept, 1))[50:]


async def test_a_consumer_is_served_only_what_a_crash_with_asynchronous_commits_keeps(
    servers: Servers, figures: Callable[[str], None], tmp_path: Path
) -> None:
    """synchronous_commit=off, with a serving producer: writers' commits and the
    producer's numbering rounds return before their WAL is written, and the producer
    serves a round only once the WAL is flushed past it. The server is killed right after
    the last commit of a burst, while the producer numbers and a consumer applies: every
    record the consumer was served survives, at its seq, and it goes on from its
    position once a producer serves again (a record served, then lost, would make it
    stop: ``ConsumerPositionError`` or ``SeqsReusedError``). What was lost was never
    served; what survived unnumbered is numbered after the crash."""
    server = servers.start(**ASYNC_COMMIT)
    url = server.url()
    ledger = str(tmp_path / "ledger.db")
    published = values(1, 300)
    received: list[tuple[int, bytes]] = []
    async with streamq.Producer(url) as producer:
        await producer.create_stream(ORDERS)  # the consumer subscribes before any record
        consuming = asyncio.create_task(
            apply_all(producer.address, ledger, len(published), received)
        )
        receipts = await asyncio.to_thread(publish, url, published[:100])
        assert await producer.wait_served(receipts[-1], timeout=20) == range(100, 101)
        await wait_for(lambda: len(received) == 100, what="the consumer to be served 100")
        # The numberer flushes a round within milliseconds, which would save the burst:
        # a lock on the log holds its next round (an EXCLUSIVE lock writes no WAL, and
        # readers still read), so the burst stays unflushed until the kill.
        blocker = psycopg.connect(url)  # closed, not committed: the server is killed
        try:
            blocker.execute("LOCK TABLE streamq_log IN EXCLUSIVE MODE")
            await asyncio.to_thread(publish, url, published[100:])
            await asyncio.to_thread(server.kill)  # the producer and the consumer still running
        finally:
            blocker.close()
        served = producer.head(ORDERS)  # what it would serve any consumer: all flushed
        consuming.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await consuming
    server.restart()

    survived = log(url)
    again = pending(url)
    figures(
        f"published {len(published)} records, {served} served ({len(received)} received), "
        f"{len(survived)} numbered and {len(again)} pending survived SIGKILL"
    )
    assert len(received) >= 100
    assert survived[: len(received)] == received  # every record served, at its seq
    assert len(survived) >= served, "the producer served seqs the crash lost"
    kept = [value for _, value in survived] + again
    assert kept == published[: len(kept)]  # commit order; none twice
    assert len(kept) < len(published), "no commit lost: the crash tested nothing"
    async with streamq.Producer(url) as producer:  # numbers the pending ones
        rest = await apply_all(producer.address, ledger, len(kept))
    # It went on from its position, told of no loss (it was served none), to the end.
    applied = rest[0][0] - 1 if rest else len(kept)  # its position when it was cancelled
    assert applied <= len(received)
    assert rest == list(enumerate(kept, 1))[applied:]
    assert log(url) == list(enumerate(kept, 1))


ROUNDS = 5  # second crashes at most, until one lost a record


def test_a_second_crash_with_asynchronous_commits_never_loses_the_new_epoch(
    servers: Servers,
) -> None:
    """After a first crash the first numbering round takes a new epoch and commits
    synchronously, though synchronous_commit is off; the rounds after it, under that
    epoch, commit asynchronously and readers of the table see them. A second crash loses
    some of those, not the epoch: the seqs written again get a higher one. (Were the
    epoch lost with them, the next round would take the same number again, for other
    records at those seqs.)"""
    server = servers.start(**ASYNC_COMMIT)
    url = server.url()
    publish_numbered(url, values(1, 50))
    first_epoch = epoch_of(epochs(url), 1)
    server.kill()
    server.restart()
    # The records numbered after the round that took the epoch (committed synchronously)
    # sit on the WAL page it flushed, which the WAL writer writes again only after
    # wal_writer_delay, unless they cross into the next page (then the writer flushes the
    # full one): a kill loses them, or, rarely, not all of them. Attempts until one lost
    # something, a few at most.
    for attempt in range(ROUNDS):
        taker = f"takes the new epoch {attempt}".encode()
        publish(url, [taker])
        assert boot_rows(url) == 0  # the writer took no epoch
        assert number(url) == 1
        (taker_seq,) = seqs_of(url, [taker])
        under = values(1, 2, f"under the new epoch {attempt}:")
        assert publish_numbered(url, under) == [taker_seq + 1, taker_seq + 2]
        seen = log(url)  # a reader of the table reads them
        seen_epoch = epoch_of(epochs(url), taker_seq + 2)
        assert seen_epoch == epoch_of(epochs(url), taker_seq) > first_epoch
        assert (taker_seq, seen_epoch) in epochs(url)  # the round's segment row
        server.kill()
        server.restart()
        head = len(log(url))
        lost_epoch = "the round that took the epoch, committed synchronously, was lost"
        assert taker_seq <= head, lost_epoch
        assert (taker_seq, seen_epoch) in epochs(url), "the epoch's segment row was lost"
        if head < len(seen):
            break
        first_epoch = seen_epoch  # nothing lost: the next round's epoch is above this one
    assert head < len(seen), f"no round lost in {ROUNDS} attempts: the crash tested nothing"
    again = pending(url)  # committed, their numbering lost
    assert again == [value for _, value in seen[head : head + len(again)]]
    publish(url, [b"after the second crash"])
    assert number(url) == len(again) + 1  # seqs written again, from head + 1
    kept = [*(value for _, value in seen[: head + len(again)]), b"after the second crash"]
    assert log(url) == list(enumerate(kept, 1))
    check_new_epoch(epoch_of(epochs(url), head + 1), seen_epoch)
    assert rewritten_from(epochs(url), seen_epoch) == head + 1


def test_a_crash_with_synchronous_commits_keeps_every_acknowledged_publish(
    servers: Servers,
) -> None:
    """synchronous_commit=on (the default): a writer's commit returns once its WAL is
    flushed, so every publish acknowledged before the SIGKILL survives it, numbered or
    not yet, and the one not committed yet is gone without a gap. Numbering rounds
    commit asynchronously (as the serving producer's do; it serves one only once
    flushed): a round the crash loses costs no record, its records are pending again and
    numbered again in the same order. The crash still starts a new epoch."""
    published = values(1, 50)
    for _ in range(ROUNDS):  # on a new server each, until the crash loses the round
        server = servers.start(**DELAYED_WAL)  # the last round stays unwritten to the kill
        url = server.url()
        publish(url, published[:30])
        assert number(url, **ASYNC) == 30  # this server life's first round: takes the epoch
        before = epochs(url)
        assert [first for first, _ in before] == [1]
        publish(url, published[30:])  # acknowledged: each commit waited for its flush
        with contextlib.closing(psycopg.connect(url)) as uncommitted:  # never committed
            receipt = streamq.publish(uncommitted, ORDERS, b"not committed")
            assert isinstance(receipt, streamq.Receipt)
            assert number(url, **ASYNC) == 20  # the uncommitted record is not numbered
            assert log(url) == list(enumerate(published, 1))
            server.kill()
        server.restart()
        survived = log(url)
        head = len(survived)
        if head < len(published):
            break
        # The WAL writer wrote the round before the kill after all (it wakes before its
        # delay, as when WAL fills a page; seen once in CI on a loaded machine): every
        # acknowledged publish survived, numbered, and nothing else. Crash another one.
        assert survived == list(enumerate(published, 1))
        assert pending(url) == []
    assert head < len(published), f"the round survived {ROUNDS} crashes: they tested nothing"
    assert head == 30  # the round before the acknowledged commits was flushed by them
    assert survived == list(enumerate(published[:head], 1))
    assert pending(url) == published[head:]  # every acknowledged one, no other
    assert epochs(url) == before
    assert boot_rows(url) == 0
    publish(url, [b"after the crash"])
    assert number(url) == len(published) - head + 1
    assert log(url) == list(enumerate([*published, b"after the crash"], 1))  # same order
    ((count, low, high),) = query(url, "SELECT count(*), min(seq), max(seq) FROM streamq_log")
    assert (count, low, high) == (51, 1, 51)  # the uncommitted record: no seq, no gap
    [(first, after)] = [segment for segment in epochs(url) if segment not in before]
    assert epochs(url) == [*before, (head + 1, after)]  # a new epoch: a crash
    assert first == head + 1 and after > before[0][1]


async def test_consumers_beyond_a_promoted_replicas_head_stop(
    servers: Servers, tmp_path: Path
) -> None:
    """The whole path: a producer serving from the primary, a consumer that applied
    everything, a failover that lost the last commits. A producer started on the promoted
    replica keeps the producer id (the database is the same); the consumer is refused with
    ``ConsumerPositionError`` while the head is below what it applied, and with
    ``SeqsReusedError`` naming the seqs once other records were written under them:
    exactly as after a power loss, never a silent skip or a silent re-apply."""
    consumer_db = str(tmp_path / "ledger.db")
    primary = servers.start()
    replica = servers.replica(primary)

    async def apply_all(address: str, count: int) -> None:
        async with streamq.Consumer(address, ORDERS, db=consumer_db, name="ledger") as c:
            async with asyncio.timeout(20):
                while c.applied < count:
                    batch = await anext(c)
                    async with c.transaction(batch):
                        pass

    async with streamq.Producer(primary.url()) as producer:
        producer_id = producer.producer_id
        for n in range(1, N + 1):
            await producer.publish(ORDERS, b"record %d" % n)
        await asyncio.to_thread(replica.wait_replayed, primary)
        await asyncio.to_thread(replica.crash)
        for n in range(N + 1, M + 1):  # commits the replica never receives
            await producer.publish(ORDERS, b"record %d" % n)
        await apply_all(producer.address, M)
    await asyncio.to_thread(primary.crash)
    await asyncio.to_thread(replica.restart)
    await asyncio.to_thread(replica.promote)

    async with streamq.Producer(replica.url()) as producer:
        assert producer.producer_id == producer_id and producer.head(ORDERS) == N
        with pytest.raises(streamq.ConsumerPositionError) as behind:
            await apply_all(producer.address, M)
        assert behind.value.lost == range(N + 1, M + 1)
        for n in range(N + 1, M + 2):  # other records under the lost seqs, and one more
            await producer.publish(ORDERS, b"after the failover %d" % n)
        with pytest.raises(streamq.SeqsReusedError) as reused:
            await apply_all(producer.address, M + 1)
        assert reused.value.lost == range(N + 1, M + 1)


LOGICAL = {"wal_level": "logical"}


async def test_a_captured_tables_consumer_is_told_of_a_failover_that_lost_changes(
    servers: Servers, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Capture through a failover: a replication slot lives on one server, so the
    promoted replica has none. The producer started there makes one (logging the LSNs
    between which changes were not captured); the changes the failover lost are lost
    with the rows themselves, and the consumer that applied them is told as for any
    stream: ``ConsumerPositionError``, then ``SeqsReusedError`` once new changes take
    their seqs."""
    consumer_db = str(tmp_path / "ledger.db")
    primary = servers.start(**LOGICAL)
    with psycopg.connect(primary.url()) as conn:
        conn.execute("CREATE TABLE orders (id integer PRIMARY KEY)")
    replica = servers.replica(primary, **LOGICAL)
    stream = "public.orders"

    async def apply_all(address: str, count: int) -> list[int]:
        ids = []
        async with streamq.Consumer(address, stream, db=consumer_db, name="ledger") as c:
            async with asyncio.timeout(30):
                while c.applied < count:
                    batch = await anext(c)
                    async with c.transaction(batch):
                        ids += [streamq.decode_change(r.value)["new"]["id"] for r in batch]
        return ids

    def insert(url: str, ids: Iterable[int]) -> None:
        with psycopg.connect(url, autocommit=True) as conn:
            for i in ids:
                conn.execute("INSERT INTO orders VALUES (%s)", (i,))

    async with streamq.Producer(primary.url(), capture=["orders"]) as producer:
        producer_id = producer.producer_id
        insert(primary.url(), range(1, N + 1))
        assert await apply_all(producer.address, N) == list(range(1, N + 1))
        await asyncio.to_thread(replica.wait_replayed, primary)
        await asyncio.to_thread(replica.crash)
        insert(primary.url(), range(N + 1, M + 1))  # changes the replica never receives
        assert await apply_all(producer.address, M) == list(range(N + 1, M + 1))
    await asyncio.to_thread(primary.crash)
    await asyncio.to_thread(replica.restart)
    await asyncio.to_thread(replica.promote)

    with caplog.at_level("ERROR", logger="streamq.capture"):
        async with streamq.Producer(replica.url(), capture=["orders"]) as producer:
            assert producer.producer_id == producer_id and producer.head(stream) == N
            assert "were not captured" in caplog.text
            with pytest.raises(streamq.ConsumerPositionError) as behind:
                await apply_all(producer.address, M)
            assert behind.value.lost == range(N + 1, M + 1)
            insert(replica.url(), range(100, 100 + M - N + 1))  # new rows, under lost seqs
            await wait_for(lambda: producer.head(stream) == M + 1, 30, "the new changes")
            with pytest.raises(streamq.SeqsReusedError) as reused:
                await apply_all(producer.address, M + 1)
            assert reused.value.lost == range(N + 1, M + 1)
