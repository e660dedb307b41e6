"""A producer process for the crash tests (tests/crashrun.py).

    producer_proc.py DB PORT TOTAL [--allow FILE] [--seed S] [--journal FILE]
                     [--survive-db-outages S]

Serves DB (a SQLite file or a ``postgresql://`` URL) on 127.0.0.1:PORT and runs
transactions that each insert orders (business rows: ``orders`` and the running
``totals``) and publish one record per order, ``b"order-<id>:<amount>"``, until the
stream ``orders`` has TOTAL records. A restarted producer continues from the committed
head. Then it keeps serving until it is killed. Its order ids are positive; other
writers (writer_proc.py) take negative ones.

``--allow FILE``: never publish beyond the number written in FILE (the test
releases records a little at a time, so the consumer always has work while it
is being killed); a transaction whose records would go beyond it, because another writer
published meanwhile, is rolled back. How many records the stream has is the number of
orders in ``totals``: every publishing transaction adds its records there, under that
row's lock until its COMMIT. (On PostgreSQL the other writers' records are numbered only
after their commit, by this serving producer, so neither the producer's head nor a seq
says that at once; see writer_proc.py.) ``--journal FILE``: every record published and
every transaction that committed, for the oracle, with their seqs (``publish``,
``commit``); on PostgreSQL, where ``publish`` returns a ``Receipt``, the records are
published ``UNNUMBERED``, and journalled as committed once served, with the seqs
``wait_served`` says.

``--survive-db-outages S`` (PostgreSQL, whose server the harness kills): a transaction
that fails because the database server went away (psycopg's ``OperationalError``, or
``DatabaseOpenError`` while it is down) is not retried as such (whether a failed COMMIT
committed is unknown: its records stay attempted, never acknowledged) and the producer
carries on with the next one, on the connections streamq opens again, for up to S seconds
of consecutive failures. Prints ``DBERROR <error>`` for each. Without it, such an error
ends the process.

Fault points (``STREAMQ_FAULT=POINT:N``, see faults.py): ``mid-tx``: the N-th
transaction kills the process after its business SQL and its publishes, before
COMMIT (whatever the allowance; sooner if all TOTAL records are published, or all the
allowance when it is ``--kill-waiting-from`` or more: the test releases no more then).
``mid-push``: the N-th RECORDS frame pushed to a consumer is cut in half and the
process dies right after writing the first half. ``STREAMQ_HOLD=mid-tx:N``: the N-th
transaction stops at the mid-tx point (see faults.py) until the test continues it; so
does one run at once, whatever the allowance, if it is still to come when the producer
waits at ``--kill-waiting-from`` (it cannot commit: the test kills the server under it).

Prints ``READY <port> head=<head>`` once serving, and
``FAULT mid-tx <n> head=<head> records=<k>`` just before killing itself mid-transaction.
A start that finds the database still served (its killed predecessor's session not yet
ended by the server) or the server away is retried for up to 20 s.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import random
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import streamq
from streamq._loop import run
from streamq.errors import AlreadyServedError, DatabaseOpenError
from streamq.protocol import ServerConnection
from tests.crash.faults import FAULTS, HOLDS
from tests.oracle import UNNUMBERED, Dialect, Journal, dialect

STREAM = "orders"
# The journal event (tests/crashrun.py reads it; the oracle reads ``publish`` and
# ``commit``) of a transaction that a writer which does not serve (writer_proc.py)
# committed, its records ``UNNUMBERED`` (the oracle's seq of a record that has none yet):
# the harness finds them in the log, or still pending, by their values.
COMMIT_UNNUMBERED = "commit-unnumbered"
MAX_BATCH = 200
NO_LIMIT = 1 << 62  # a transaction that dies before COMMIT may publish beyond the allowance
# Records per executemany into streamq_log, so big transactions write part of
# the log before COMMIT (and the mid-transaction kill leaves uncommitted rows).
FLUSH_RECORDS = 64
START_TIMEOUT = 20.0
# A transaction's records are served when its block ends: wait_served answers at once.
SERVED_TIMEOUT = 5.0
# Seconds a committed transaction's block may wait for its records to be served (numbered
# and flushed, through a server restart); beyond, the process says so and exits 3 (the
# block would wait for ever: a lost receipt).
SERVE_PATIENCE = 20.0


class Overshoot(Exception):
    """Other writers published meanwhile: this transaction's seqs go beyond the allowance."""


def outage_errors(db: str) -> tuple[type[BaseException], ...]:
    """What a transaction raises when the database server goes away (PostgreSQL)."""
    if dialect(db).engine != "postgres":
        return ()
    import psycopg

    return (psycopg.OperationalError, psycopg.InterfaceError, DatabaseOpenError)


def unnumbered(values: Iterable[bytes]) -> list[tuple[int, bytes]]:
    """Records for the journal that have no seq yet."""
    return [(UNNUMBERED, value) for value in values]


# The orders committed, which is the stream's records committed (numbered or not): every
# publishing transaction adds its records here. As UPDATE ... RETURNING, under the row's lock.
COUNT_ORDERS = "SELECT n FROM totals WHERE name = 'orders'"
ADD_ORDERS = "UPDATE totals SET n = n + ?, amount = amount + ? WHERE name = 'orders' RETURNING n"


def allowance(path: str | None, total: int) -> int:
    if path is None:
        return total
    try:
        text = Path(path).read_text().strip()
    except FileNotFoundError:
        return 0
    return min(total, int(text)) if text else 0


async def setup(producer: streamq.Producer, d: Dialect) -> None:
    async with producer.transaction() as tx:
        await tx.execute(
            "CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY, amount INTEGER NOT NULL)"
        )
        await tx.execute(
            "CREATE TABLE IF NOT EXISTS totals "
            "(name TEXT PRIMARY KEY, n INTEGER NOT NULL, amount INTEGER NOT NULL)"
        )
        await tx.execute(d.insert_or_ignore("totals (name, n, amount) VALUES ('orders', 0, 0)"))
    await producer.create_stream(STREAM)


def arm_mid_push() -> None:
    """Cut the N-th RECORDS frame in half and die once its first half is written."""
    send_records = ServerConnection.send_records

    dying: list[str] = []  # the fault's detail, once the half frame is out

    def cut(
        self: ServerConnection,
        encoded_records: Sequence[bytes],
        epoch: int | None = None,
        through: int | None = None,
        count: int | None = None,
    ) -> bytes:
        if dying:  # the half frame was handed to the socket: die before any further frame
            FAULTS.fire("mid-push", dying[0])
        data = send_records(self, encoded_records, epoch, through, count)
        if FAULTS.due("mid-push"):
            records = len(encoded_records) if count is None else count
            dying.append(f"frame={len(data)} bytes records={records}")
            asyncio.get_running_loop().call_soon(FAULTS.fire, "mid-push", dying[0])
            return data[: len(data) // 2]
        return data

    ServerConnection.send_records = cut  # type: ignore[method-assign]


def make_orders(rng: random.Random, last_id: int, count: int) -> list[tuple[int, int]]:
    """``count`` orders after ``last_id``: ids with gaps, not the same numbers as seqs."""
    orders = []
    for _ in range(count):
        last_id += rng.randint(1, 3)
        orders.append((last_id, rng.randint(1, 10_000)))
    return orders


class Withdrawn(Exception):
    """A member of a commit group that gives up: it rolls back alone."""


def group_member(
    tx: streamq.BlockingTransaction,
    d: Dialect,
    seed: int,
    count: int,
    limit: int,
    journal: Journal,
    kill: bool,
    withdraw: bool,
    head: Callable[[], int],
) -> list[tuple[int, bytes]]:
    """``one_transaction`` as a member of a commit group (``run_in_transaction``), on the
    writer's thread. Its order ids follow those of the members before it, which it sees;
    ``withdraw``: it raises after publishing, and rolls back alone."""
    rng = random.Random(seed)
    row = tx.execute("SELECT COALESCE(MAX(id), 0) FROM orders WHERE id > 0").fetchone()
    orders = make_orders(rng, int(row[0]), count)
    values = [b"order-%d:%d" % order for order in orders]
    tx.executemany(d.sql("INSERT INTO orders (id, amount) VALUES (?, ?)"), orders)
    seqs = tx.publish_many(STREAM, values)
    journal.write("publish", zip(seqs, values, strict=True))
    if seqs[-1] > limit:
        raise Overshoot
    tx.execute(
        d.sql("UPDATE totals SET n = n + ?, amount = amount + ? WHERE name = 'orders'"),
        (count, sum(amount for _, amount in orders)),
    )
    if kill:  # the members before it are in the group's open transaction: lost with it
        FAULTS.fire("mid-tx", f"head={head()} records={count} (a commit group's member)")
    if withdraw:
        raise Withdrawn
    return list(zip(seqs, values, strict=True))


async def group_round(
    producer: streamq.Producer,
    d: Dialect,
    rng: random.Random,
    limit: int,
    journal: Journal,
    *,
    kill: bool = False,
) -> None:
    """2 to 8 concurrent ``run_in_transaction`` calls, which the producer commits as one
    group (members in their own savepoints); some withdraw, one dies with ``kill``."""
    size = rng.randint(2, 8)
    killer = rng.randrange(size) if kill else None
    calls = [
        producer.run_in_transaction(
            group_member,
            d,
            rng.randrange(2**32),
            rng.randint(1, 40),
            limit,
            journal,
            i == killer,
            rng.random() < 0.2,
            functools.partial(producer.head, STREAM),
        )
        for i in range(size)
    ]
    for outcome in await asyncio.gather(*calls, return_exceptions=True):
        if isinstance(outcome, list):
            journal.write("commit", outcome)
        elif not isinstance(outcome, Withdrawn | Overshoot):
            raise outcome


class Watchdog:
    """Where a transaction's block ends once its records are served (PostgreSQL), a
    block still waiting ``SERVE_PATIENCE`` after its COMMIT returned ends the process
    with ``UNSERVED <receipt>`` and exit code 3, instead of waiting for ever."""

    def __init__(self) -> None:
        self.tx: streamq.Transaction | None = None  # the transaction block open, if any
        self.since: tuple[streamq.Transaction, float] | None = None

    async def run(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            tx = self.tx
            if tx is None or not tx.committed:
                self.since = None
            elif self.since is None or self.since[0] is not tx:
                self.since = (tx, time.monotonic())
            elif time.monotonic() - self.since[1] > SERVE_PATIENCE:
                print(
                    f"UNSERVED {tx.last_receipt}: committed {SERVE_PATIENCE:g} s ago, its "
                    "records still not served",
                    flush=True,
                )
                os._exit(3)


WATCHDOG = Watchdog()


async def one_transaction(
    producer: streamq.Producer,
    d: Dialect,
    rng: random.Random,
    count: int,
    limit: int | None,
    journal: Journal,
    *,
    kill: bool = False,
    hold: bool = False,
) -> None:
    """One transaction of ``count`` orders: rolled back (``Overshoot``) if its records
    would take the stream beyond ``limit`` (None: wherever they go); killed before COMMIT
    with ``kill``; held there with ``hold`` (whatever its hit, see HOLDS), or at the hit
    HOLDS is set for."""
    try:
        async with producer.transaction() as tx:
            WATCHDOG.tx = tx
            cursor = await tx.execute("SELECT COALESCE(MAX(id), 0) FROM orders WHERE id > 0")
            row = await cursor.fetchone()
            assert row is not None
            orders = make_orders(rng, int(row[0]), count)
            values = [b"order-%d:%d" % order for order in orders]
            business_first = rng.random() < 0.5
            insert = d.sql("INSERT INTO orders (id, amount) VALUES (?, ?)")
            if business_first:
                await tx.executemany(insert, orders)
            published: int | range | streamq.Receipt
            if count == 1:
                published = await tx.publish(STREAM, values[0], key=b"%d" % orders[0][0])
            else:
                published = await tx.publish_many(STREAM, values)
            seqs: Sequence[int] | None = None
            if isinstance(published, streamq.Receipt):  # seqs given after the commit
                receipt = published
                assert receipt.count == count, receipt
                journal.write("publish", unnumbered(values))
            else:
                seqs = [published] if isinstance(published, int) else published
                journal.write("publish", zip(seqs, values, strict=True))
            if not business_first:
                await tx.executemany(insert, orders)
            cursor = await tx.execute(d.sql(ADD_ORDERS), (count, sum(a for _, a in orders)))
            row = await cursor.fetchone()
            assert row is not None
            committed = int(row[0])  # the stream's records, with these if they commit
            # Where seqs are known at publish (SQLite), they end at that count: one writer
            # at a time, each adding its records to it.
            assert seqs is None or seqs[-1] == committed, (seqs[-1], committed)
            if limit is not None and committed > limit:
                raise Overshoot
            if hold or HOLDS.due("mid-tx"):
                HOLDS.hold("mid-tx", f"records={count}")
            if kill:
                FAULTS.fire("mid-tx", f"head={producer.head(STREAM)} records={count}")
    finally:
        WATCHDOG.tx = None
    if seqs is None:  # committed and (the block waited for it) served: its seqs are known
        seqs = await producer.wait_served(receipt, timeout=SERVED_TIMEOUT)
        assert len(seqs) == count, (receipt, seqs)
    journal.write("commit", zip(seqs, values, strict=True))


async def committed_head(producer: streamq.Producer) -> int:
    """How many records the stream has, committed: the producer's head (SQLite: caught up
    with the other connections at BEGIN); where the other writers' records are numbered
    after their commit (PostgreSQL), the orders committed (``COUNT_ORDERS``)."""
    if not producer.storage.features.numbered_after_commit:
        return producer.head(STREAM)
    async with producer.transaction() as tx:
        cursor = await tx.execute(COUNT_ORDERS)
        row = await cursor.fetchone()
    assert row is not None
    return int(row[0])


async def start(args: argparse.Namespace, settings: streamq.ServerSettings) -> streamq.Producer:
    """The producer, started; retried while its killed predecessor's serving session is
    still there (PostgreSQL ends it once it notices) or, surviving outages, the server is away."""
    retry: tuple[type[BaseException], ...] = (AlreadyServedError,)
    if args.survive_db_outages:
        retry += outage_errors(args.db)
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        producer = streamq.Producer(
            args.db,
            host="127.0.0.1",
            port=args.port,
            flush_records=FLUSH_RECORDS,
            settings=settings,
        )
        try:
            await producer.start()
            await setup(producer, dialect(args.db))
            return producer
        except retry as exc:
            await producer.close()
            if time.monotonic() > deadline:
                raise
            print(f"RETRY start: {type(exc).__name__}: {exc}", flush=True)
            await asyncio.sleep(0.05)  # until the old session is gone: bounded by deadline


async def main(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    journal = Journal(args.journal)
    d = dialect(args.db)
    outages = outage_errors(args.db) if args.survive_db_outages else ()
    if FAULTS.armed("mid-push"):
        arm_mid_push()
    # Small timeouts, so that a pause (SIGSTOP) outlasts every one of them.
    settings = streamq.ServerSettings(
        heartbeat_interval=args.heartbeat_interval,
        handshake_timeout=1.0,
        idle_timeout=1.0,
        frame_timeout=1.0,
    )
    failing_since: float | None = None  # the first of consecutive database errors
    producer = await start(args, settings)
    watchdog = asyncio.create_task(WATCHDOG.run())
    # Commit groups are SQLite's (PostgreSQL groups its own WAL flushes).
    groups = producer.storage.writer.threaded is not None
    try:
        print(f"READY {args.port} head={producer.head(STREAM)}", flush=True)
        while True:
            kill = False
            try:
                head = await committed_head(producer)
                limit = allowance(args.allow, args.total)
                # Waiting for records the test releases only once its kills are over.
                at_cap = limit <= head and limit >= args.kill_waiting_from
                # The N-th transaction is killed; so is the next one once all is published,
                # or at the cap. A transaction to hold does not wait either: it cannot commit
                # (the test kills the database server under it).
                kill = FAULTS.armed("mid-tx") and (head >= args.total or at_cap)
                hold = HOLDS.pending("mid-tx") and at_cap and not kill
                if head >= limit and not (kill or hold):
                    if head >= args.total:
                        break
                    await asyncio.sleep(0.005)
                    continue
                kill = FAULTS.due("mid-tx") or kill
                count = rng.randint(1, MAX_BATCH)
                if not (kill or hold):
                    count = min(count, limit - head)
                try:
                    if groups and not hold and rng.random() < 0.3:
                        await group_round(
                            producer, d, rng, NO_LIMIT if kill else limit, journal, kill=kill
                        )
                    else:
                        await one_transaction(
                            producer,
                            d,
                            rng,
                            count,
                            None if kill or hold else limit,
                            journal,
                            kill=kill,
                            hold=hold,
                        )
                except Overshoot:
                    await producer.refresh()  # learn the other writers' commits
                    continue
            except outages as exc:
                if kill:  # it failed before its fault point: the next one dies there
                    FAULTS.again("mid-tx")
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since > args.survive_db_outages:
                    raise
                print(f"DBERROR {type(exc).__name__}: {str(exc).strip()[:200]}", flush=True)
                await asyncio.sleep(0.05)  # the server is being restarted: bounded above
                continue
            failing_since = None
            if args.pace:
                await asyncio.sleep(count / args.pace * rng.uniform(0.5, 1.5))
        print(f"COMPLETE head={head}", flush=True)
        await asyncio.Event().wait()  # serve until killed
    finally:
        watchdog.cancel()
        await producer.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("db")
    parser.add_argument("port", type=int)
    parser.add_argument("total", type=int)
    parser.add_argument("--journal", default=None)
    parser.add_argument("--heartbeat-interval", type=float, default=0.2)
    parser.add_argument("--allow", default=None)
    parser.add_argument("--pace", type=float, default=0.0, help="records per second (0: no pause)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--survive-db-outages", type=float, default=0.0, metavar="SECONDS")
    parser.add_argument("--kill-waiting-from", type=int, default=2**62, metavar="ALLOWANCE")
    sys.exit(run(main(parser.parse_args())))
