"""PostgreSQL failover and server crashes, on real servers (``tests/pgserver.py``). What
must hold: the records a crash or a failover loses are never replaced silently. Their seqs
are numbered again, densely from the surviving head, under a higher epoch
(``streamq_epochs``), so a consumer that remembers the (epoch, seq) it read up to can tell
its records are gone (``streamq/engines/postgres/append.py``; docs/protocol.md, "Epochs").

Each test has servers of its own, since it kills them. Two tests are the cases that
once reused an epoch: a failover after the old primary took an epoch the replica never
received (epochs are at least the WAL timeline << 42), and a second crash losing an
epoch taken with synchronous_commit=off (a new epoch now commits synchronously).
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
from streamq.protocol import decode_record

from .pgserver import PostgresMissingError, PostgresServer, find_bindir

ORDERS = "orders"
# Crash tests with synchronous_commit=off: a commit returns before its WAL is written,
# and the WAL writer writes the last, partial WAL page only every wal_writer_delay
# (200 ms by default). 10 s: a kill right after the last commit loses the commits on that
# page whatever the machine's speed, instead of most of the time.
# Autovacuum off: its commits flush the WAL (synchronously) and would save the records a
# test means to lose, when a loaded machine lets it run in between.
ASYNC_COMMIT = {"synchronous_commit": "off", "wal_writer_delay": "10s", "autovacuum": "off"}


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

    def replica(self, primary: PostgresServer) -> PostgresServer:
        replica = primary.replica()
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


def publish(url: str, values: Iterable[bytes]) -> list[int]:
    """Publish each value in a transaction of its own, committed; the seqs returned."""
    seqs = []
    with psycopg.connect(url) as conn:
        for value in values:
            seqs.append(streamq.publish(conn, ORDERS, value))
            conn.commit()
    return seqs


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
    """Rows of the unlogged streamq_boot: 0 until a writer of this server life takes an
    epoch (unreadable on a standby: unlogged tables cannot be read during recovery)."""
    ((count,),) = query(url, "SELECT count(*) FROM streamq_boot")
    return int(count)


def values(first: int, last: int, prefix: str = "record") -> list[bytes]:
    return [f"{prefix} {n}".encode() for n in range(first, last + 1)]


N, M = 5, 9  # records the replica replays; records only the old primary has (N+1..M)


def test_a_promoted_replica_numbers_the_lost_seqs_again_under_a_higher_epoch(
    servers: Servers,
) -> None:
    """Asynchronous replication: the replica misses the primary's last commits, and the
    failover loses them. The promoted replica goes on from its own head, N, so seqs
    N+1..M are written again, to other records: under a higher epoch, because the
    unlogged streamq_boot is empty on a promoted replica."""
    primary = servers.start()
    assert publish(primary.url(), values(1, 2)) == [1, 2]
    assert boot_rows(primary.url()) == 1  # copied by the base backup? (no: unlogged)
    replica = servers.replica(primary)
    assert publish(primary.url(), values(3, N)) == list(range(3, N + 1))
    replica.wait_replayed(primary)
    assert log(replica.url()) == list(enumerate(values(1, N), 1))  # copied, then streamed
    replica.crash()
    assert publish(primary.url(), values(N + 1, M)) == list(range(N + 1, M + 1))
    old_segments = epochs(primary.url())
    seen_epoch = epoch_of(old_segments, M)  # what a consumer that read up to M remembers
    primary.crash()  # the replica never received N+1..M

    replica.restart()
    replica.promote()
    url = replica.url()
    assert log(url) == list(enumerate(values(1, N), 1))  # the head is N
    assert epochs(url) == [s for s in old_segments if s[0] <= N]
    assert boot_rows(url) == 0  # unlogged: neither the base backup nor the WAL has it
    assert publish(url, [b"after the failover"]) == [N + 1]
    assert boot_rows(url) == 1  # this server life took its epoch
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
    writer takes a new epoch for N+1..M. The asynchronous replica had stopped before and
    never receives them; promoted, it is on a new WAL timeline, and the epoch it takes
    is above every epoch of the old one's: a consumer that read N+1..M is told they were
    written again."""
    primary = servers.start()
    replica = servers.replica(primary)
    publish(primary.url(), values(1, N))
    replica.wait_replayed(primary)
    replica.crash()
    primary.crash()
    primary.restart()  # crash recovery: streamq_boot emptied
    assert publish(primary.url(), values(N + 1, M)) == list(range(N + 1, M + 1))
    old_segments = epochs(primary.url())
    assert [first for first, _ in old_segments] == [1, N + 1]  # the crash: a new epoch
    assert old_segments[0][1] < old_segments[1][1]
    seen_epoch = epoch_of(old_segments, M)
    primary.crash()

    replica.restart()
    replica.promote()
    assert publish(replica.url(), [b"after the failover"]) == [N + 1]
    new_segments = epochs(replica.url())
    check_new_epoch(epoch_of(new_segments, N + 1), seen_epoch)  # counters alone: both equal
    assert rewritten_from(new_segments, seen_epoch) == N + 1


def test_a_crash_with_asynchronous_commits_numbers_again_from_the_surviving_head(
    servers: Servers, figures: Callable[[str], None]
) -> None:
    """synchronous_commit=off: a commit returns (and readers see it) before its WAL is
    written, so SIGKILL loses the last ones. Whatever survived, the seqs go on densely
    from the surviving head, under an epoch above every epoch a reader saw before."""
    server = servers.start(**ASYNC_COMMIT)
    url = server.url()
    published = values(1, 100)
    assert publish(url, published) == list(range(1, 101))
    seen = log(url)  # what a consumer could read before the crash: all 100
    assert seen == list(enumerate(published, 1))
    seen_segments = epochs(url)
    server.kill()
    server.restart()

    survived = log(url)
    head = len(survived)
    figures(f"published {len(published)} records, {head} survived SIGKILL")
    assert head < len(seen), "no commit lost: the crash tested nothing"
    assert survived == seen[:head]  # a prefix: commit order is seq order
    assert epochs(url) == seen_segments  # the segment rows of survivors survive with them
    assert boot_rows(url) == 0  # crash recovery reset the unlogged table
    assert publish(url, [b"after the crash"]) == [head + 1]
    assert log(url) == [*seen[:head], (head + 1, b"after the crash")]  # dense, no gap
    ((count, low, high),) = query(url, "SELECT count(*), min(seq), max(seq) FROM streamq_log")
    assert (count, low, high) == (head + 1, 1, head + 1)
    new_epoch = epoch_of(epochs(url), head + 1)
    seen_epoch = max(epoch for _, epoch in seen_segments)
    check_new_epoch(new_epoch, seen_epoch)
    assert rewritten_from(epochs(url), seen_epoch) == head + 1  # a consumer at 100 is told


ROUNDS = 5  # second crashes at most, until one lost a record


def test_a_second_crash_with_asynchronous_commits_never_loses_the_new_epoch(
    servers: Servers,
) -> None:
    """After a first crash the first writer takes a new epoch and commits it synchronously,
    though synchronous_commit is off; the records after it, under that epoch, commit
    asynchronously and readers see them. A second crash loses some of those, not the
    epoch: the seqs written again get a higher one. (Were the epoch lost with them, the
    next writer would take the same number again, for other records at those seqs.)"""
    server = servers.start(**ASYNC_COMMIT)
    url = server.url()
    publish(url, values(1, 50))
    first_epoch = epoch_of(epochs(url), 1)
    server.kill()
    server.restart()
    # The records after the epoch's synchronous commit sit on the WAL page it flushed,
    # which the WAL writer writes again only after wal_writer_delay, unless they cross
    # into the next page (then the writer flushes the full one): a kill loses them, or,
    # rarely, not all of them. Rounds until one lost something, a few at most.
    for _ in range(ROUNDS):
        (taker,) = publish(url, [b"takes the new epoch"])
        seen = publish(url, values(1, 2, "under the new epoch"))  # a consumer reads them
        seen_epoch = epoch_of(epochs(url), seen[-1])
        assert seen_epoch == epoch_of(epochs(url), taker) > first_epoch
        server.kill()
        server.restart()
        head = len(log(url))
        assert taker <= head, "the epoch's first record, committed synchronously, was lost"
        if head < seen[-1]:
            break
        first_epoch = seen_epoch  # nothing lost: the next round's epoch is above this one
    assert head < seen[-1], f"no commit lost in {ROUNDS} rounds: the crash tested nothing"
    assert publish(url, [b"after the second crash"]) == [head + 1]  # seqs written again
    check_new_epoch(epoch_of(epochs(url), head + 1), seen_epoch)
    assert rewritten_from(epochs(url), seen_epoch) == head + 1


def test_a_crash_with_synchronous_commits_keeps_every_acknowledged_publish(
    servers: Servers,
) -> None:
    """synchronous_commit=on (the default): a commit returns once its WAL is flushed, so
    every publish acknowledged before the SIGKILL survives it, and the one not committed
    yet is gone without a gap. The crash still starts a new epoch."""
    server = servers.start()
    url = server.url()
    published = values(1, 50)
    assert publish(url, published) == list(range(1, 51))
    before = epochs(url)
    with contextlib.closing(psycopg.connect(url)) as pending:  # closed, never committed
        assert streamq.publish(pending, ORDERS, b"not committed") == 51
        server.kill()
    server.restart()

    assert log(url) == list(enumerate(published, 1))  # every acknowledged one, no other
    assert [first for first, _ in before] == [1]
    assert epochs(url) == before
    assert publish(url, [b"after the crash"]) == [51]  # the uncommitted seq, reused
    ((count, low, high),) = query(url, "SELECT count(*), min(seq), max(seq) FROM streamq_log")
    assert (count, low, high) == (51, 1, 51)
    [(_, after)] = [segment for segment in epochs(url) if segment not in before]
    assert epochs(url) == [*before, (51, after)]  # nothing lost, yet a new epoch: a crash
    assert after > before[0][1]


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
