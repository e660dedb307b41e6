"""Poison records: ``Consumer(on_failure=Stop() | Retry(...) | DeadLetter(...))`` over real
sockets, into a consumer database of either engine (SQLite, PostgreSQL), and as real
processes: a consumer killed with ``kill -9`` between parking a record and committing,
then ``streamq dead-letters list|retry`` and the record re-applied exactly once.

Run as ``python -m tests.consumer.test_poison ADDRESS DB TARGET`` this module is that consumer.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

import streamq
from streamq import Batch, Consumer, DeadLetter, Producer, RecordFailedError, Retry
from streamq.engines import is_postgres_url
from streamq.errors import OutOfOrderBatchError

from ..conftest import wait_for

ROOT = Path(__file__).resolve().parents[2]
STREAMQ = [sys.executable, "-m", "streamq"]
POISON = b"poison"


@dataclass
class Db:
    """The consumer's database, on one engine, with an effects table ``credits`` whose
    ``n`` says in which order records were applied, and that refuses values of 20 bytes
    or more (a poison the database finds: on PostgreSQL it aborts the transaction)."""

    engine: str
    url: str

    @property
    def insert(self) -> str:
        placeholder = "%s" if self.engine == "postgres" else "?"
        return f"INSERT INTO credits (seq, value) VALUES ({placeholder}, {placeholder})"

    def execute(self, statement: str) -> None:
        """``statement`` on a new connection, committed."""
        if self.engine == "postgres":
            with psycopg.connect(self.url) as conn:
                conn.execute(statement)
        else:
            with contextlib.closing(sqlite3.connect(self.url)) as conn, conn:
                conn.execute(statement)

    def query(self, statement: str) -> list[tuple[Any, ...]]:
        """Rows as a new connection sees them (what is committed)."""
        if self.engine == "postgres":
            with psycopg.connect(self.url) as conn:
                return conn.execute(statement).fetchall()
        with contextlib.closing(sqlite3.connect(self.url)) as conn:
            return conn.execute(statement).fetchall()

    def credits(self) -> list[int]:
        return [seq for (seq,) in self.query("SELECT seq FROM credits ORDER BY n")]

    def positions(self) -> list[int]:
        return [seq for (seq,) in self.query("SELECT seq FROM streamq_positions")]

    def parked(self) -> list[int]:
        rows = self.query("SELECT seq FROM streamq_dead_letters ORDER BY seq")
        return [seq for (seq,) in rows]


def create_effects(url: str) -> None:
    if is_postgres_url(url):
        with psycopg.connect(url) as conn:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS credits "
                "(n bigserial PRIMARY KEY, seq bigint NOT NULL, value bytea NOT NULL "
                "CHECK (length(value) < 20))"
            )
    else:
        with contextlib.closing(sqlite3.connect(url)) as conn, conn:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS credits "
                "(n INTEGER PRIMARY KEY AUTOINCREMENT, seq INTEGER NOT NULL, value BLOB NOT NULL "
                "CHECK (length(value) < 20))"
            )


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest, consumer_db: str) -> Db:
    url = request.getfixturevalue("pg_url") if request.param == "postgres" else consumer_db
    create_effects(url)
    return Db(request.param, url)


def credit(tx: Any, batch: Batch, insert: str, poison: bytes | None = POISON) -> int:
    """The application's apply function: a row per record, one at a time, so a poison
    record fails with the records before it already written (and rolled back)."""
    for record in batch:
        if record.value == poison:
            raise ValueError(f"cannot apply {record.value!r}")
        tx.execute(insert, (record.seq, record.value))
    return len(batch)


async def publish(producer: Producer, *values: bytes) -> None:
    """In one transaction: the consumer gets them as one batch."""
    async with producer.transaction() as tx:
        for value in values:
            await tx.publish("orders", value, key=b"k-" + value, headers={"h": value})


def test_policies_are_checked() -> None:
    with pytest.raises(ValueError, match="no negative"):
        Retry(times=-1)
    with pytest.raises(TypeError, match="on_failure takes"):
        Consumer("127.0.0.1:1", "orders", on_failure="park")  # type: ignore[arg-type]
    assert Retry(backoff=0.1, max_backoff=0.3).delay(1) == 0.1
    assert [Retry(backoff=0.1, max_backoff=0.3).delay(n) for n in (2, 3, 4)] == [0.2, 0.3, 0.3]
    assert DeadLetter().retry == Retry(times=0)


async def test_stop_names_the_record_and_commits_nothing(producer_db: str, db: Db) -> None:
    async with Producer(producer_db) as producer:
        await publish(producer, b"1", b"2", POISON, b"4", b"5")
        async with Consumer(producer.address, "orders", db=db.url, name="ledger") as consumer:
            batch = await anext(consumer)
            with pytest.raises(ValueError, match="cannot apply") as info:  # today's error
                await consumer.apply(batch, credit, db.insert)
            note = "\n".join(info.value.__notes__)
            assert "consumer 'ledger' stopped at seq 3 of stream 'orders'" in note
            assert f"from producer {producer.producer_id} at {producer.address}" in note
            assert "nothing of its batch (seqs 1..5) committed" in note
            assert consumer.applied == 0 and db.credits() == [] and db.positions() == []
            # Fixed, the same batch applies, once.
            assert await consumer.apply(batch, credit, db.insert, None) == 5
    assert db.credits() == [1, 2, 3, 4, 5] and db.positions() == [5]


async def test_retry_rides_out_a_transient_failure_then_gives_up_on_poison(
    producer_db: str, db: Db
) -> None:
    failures = 2

    def flaky(tx: Any, batch: Batch) -> int:
        nonlocal failures
        if failures:
            failures -= 1
            credit(tx, batch, db.insert)  # written, then rolled back
            raise ConnectionResetError("the ledger service blinked")
        return credit(tx, batch, db.insert)

    policy = Retry(times=2, backoff=0.01, max_backoff=0.02)
    async with Producer(producer_db) as producer:
        await publish(producer, b"1", b"2", b"3")
        async with Consumer(
            producer.address, "orders", db=db.url, name="ledger", on_failure=policy
        ) as consumer:
            assert await consumer.apply(await anext(consumer), flaky) == 3
            assert consumer.retried == 2 and db.credits() == [1, 2, 3]

            await publish(producer, b"4", POISON, b"6")
            batch = await anext(consumer)
            with pytest.raises(RecordFailedError) as info:
                await consumer.apply(batch, credit, db.insert)
            error = info.value
            assert (error.consumer, error.stream, error.seq) == ("ledger", "orders", 5)
            assert (error.producer_id, error.address) == (producer.producer_id, producer.address)
            assert error.attempts >= 3  # the batch's 3 tries, then alone
            assert isinstance(error.__cause__, ValueError)
            assert "stopped at seq 5 of stream 'orders'" in str(error)
            assert consumer.retried == 4 and consumer.applied == 3
    assert db.credits() == [1, 2, 3] and db.positions() == [3]  # nothing of 4..6


async def test_dead_letter_parks_exactly_the_poison_records(producer_db: str, db: Db) -> None:
    too_long = b"x" * 20  # refused by the database, not by the application's code
    async with Producer(producer_db) as producer:
        await publish(producer, b"1", b"2", POISON, b"4", too_long, b"6", b"7", POISON, b"9", b"10")
        async with Consumer(
            producer.address, "orders", db=db.url, name="ledger", on_failure=DeadLetter()
        ) as consumer:
            batch = await anext(consumer)
            assert await consumer.apply(batch, credit, db.insert) == 7  # the parts' counts
            assert db.credits() == [1, 2, 4, 6, 7, 9, 10]  # once each, in seq order
            assert db.parked() == [3, 5, 8] and db.positions() == [10]
            assert consumer.parked == 3 and consumer.applied == 10
            with pytest.raises(OutOfOrderBatchError):  # not the record's: no policy
                await consumer.apply(batch, credit, db.insert)

            await publish(producer, POISON)  # a batch of one: parked without another try
            assert await consumer.apply(await anext(consumer), credit, db.insert) is None
            assert db.parked() == [3, 5, 8, 11] and db.positions() == [11]
            assert consumer.parked == 4
    parked = streamq.list_dead_letters(db.url)
    assert [(p.consumer, p.producer_id, p.stream) for p in parked] == [
        ("ledger", producer.producer_id, "orders")
    ] * 4
    assert "IntegrityError" in parked[1].error or "CheckViolation" in parked[1].error
    first = parked[0]
    assert first.record.seq == 3 and first.record.value == POISON
    assert (first.record.key, first.record.headers) == (b"k-poison", {"h": POISON})
    assert first.error.splitlines()[-1] == "ValueError: cannot apply b'poison'"
    assert "Traceback" in first.error and first.retry_requested_at is None
    assert first.attempts > 1 and parked[3].attempts == 1
    assert streamq.list_dead_letters(db.url, consumer="other") == []


async def test_each_parked_record_keeps_its_own_error(producer_db: str, db: Db) -> None:
    def picky(tx: Any, batch: Batch) -> int:
        """Seqs 2 and 7 fail with a TypeError, seqs 4 and 9 with a KeyError."""
        for record in batch:
            if record.seq in (2, 7):
                raise TypeError(f"seq {record.seq} is no number")
            if record.seq in (4, 9):
                raise KeyError(f"seq {record.seq} names no account")
            tx.execute(db.insert, (record.seq, record.value))
        return len(batch)

    async with Producer(producer_db) as producer:
        await publish(producer, b"1", b"2", b"3", b"4", b"5")
        async with Consumer(
            producer.address, "orders", db=db.url, name="ledger", on_failure=DeadLetter()
        ) as consumer:
            assert await consumer.apply(await anext(consumer), picky) == 3
            await publish(producer, b"6", b"7", b"8", b"9", b"10")
            batch = await anext(consumer)
            try:  # applied while the application handles an exception of its own
                raise LookupError("the caller's own failure")
            except LookupError:
                assert await consumer.apply(batch, picky) == 3
    letters = streamq.list_dead_letters(db.url)
    assert [p.record.seq for p in letters] == [2, 4, 7, 9]
    other = {2: 4, 4: 2, 7: 9, 9: 7}  # the batch's other failing record
    for letter in letters:
        seq, error = letter.record.seq, letter.error
        kind, foreign = ("TypeError", "KeyError") if seq in (2, 7) else ("KeyError", "TypeError")
        assert error.startswith("Traceback") and error.count("Traceback") == 1
        assert error.splitlines()[-1].startswith(f"{kind}: ") and f"seq {seq} " in error
        # Not chained to the other record's error, the batch's, or the caller's.
        assert foreign not in error and f"seq {other[seq]} " not in error
        assert "LookupError" not in error and "During handling" not in error
    assert db.credits() == [1, 3, 5, 6, 8, 10]


async def test_parked_records_are_reapplied_once_on_request(producer_db: str, db: Db) -> None:
    async with Producer(producer_db) as producer:
        await publish(producer, b"1", POISON, b"3")
        async with (
            Consumer(
                producer.address, "orders", db=db.url, name="ledger", on_failure=DeadLetter()
            ) as a,
            Consumer(producer.address, "orders", db=db.url, name="ledger") as b,
        ):
            await a.apply(await anext(a), credit, db.insert)
            assert db.parked() == [2]
            assert await a.retry_dead_letters(credit, db.insert, None) == 0  # not marked
            assert streamq.mark_for_retry(db.url, consumer="ledger", seq=9) == 0
            assert streamq.mark_for_retry(db.url, consumer="ledger", seq=2) == 1
            (marked,) = streamq.list_dead_letters(db.url)
            assert marked.retry_requested_at is not None
            # Still failing: it stays parked, one more attempt, no longer marked.
            assert await a.retry_dead_letters(credit, db.insert) == 0
            (letter,) = streamq.list_dead_letters(db.url)
            assert letter.retry_requested_at is None and db.parked() == [2]
            assert letter.attempts == marked.attempts + 1
            # Fixed (``a`` re-applies with it from now on, by itself too), and two
            # processes at it at once: applied once.
            assert await a.retry_dead_letters(credit, db.insert, None) == 0
            assert streamq.mark_for_retry(db.url) == 1
            both = await asyncio.gather(
                a.retry_dead_letters(credit, db.insert, None),
                b.retry_dead_letters(credit, db.insert, None),
            )
            # (0, 0) if a's own look, a second after its last, came first on a slow machine.
            assert sorted(both) in ([0, 1], [0, 0]) and a.reapplied + b.reapplied == 1
            assert db.parked() == [] and db.credits() == [1, 3, 2]
            assert streamq.list_dead_letters(db.url) == []


async def test_marked_records_are_reapplied_on_a_quiet_stream(producer_db: str, db: Db) -> None:
    """Nothing is published after ``streamq dead-letters retry``: the consumer re-applies
    the marked record by itself, with the function of its last ``apply``."""
    fixed = False

    def ledger(tx: Any, batch: Batch) -> int:
        return credit(tx, batch, db.insert, None if fixed else POISON)

    async with Producer(producer_db) as producer:
        await publish(producer, b"1", POISON, b"3")
        async with Consumer(
            producer.address, "orders", db=db.url, name="ledger", on_failure=DeadLetter()
        ) as consumer:
            assert await consumer.apply(await anext(consumer), ledger) == 2
            assert db.parked() == [2] and consumer.parked == 1
            fixed = True  # the fix, deployed
            marked = await asyncio.to_thread(streamq.mark_for_retry, db.url, consumer="ledger")
            assert marked == 1
            await wait_for(lambda: consumer.reapplied == 1, timeout=30, what="seq 2 re-applied")
            assert db.parked() == [] and db.credits() == [1, 3, 2] and db.positions() == [3]
            # No record came after the mark: no batch brought the retry.
            assert producer.log.streams["orders"].head == 3
            assert consumer.batches_applied == 1 and consumer.received == consumer.applied == 3


async def test_a_failed_look_for_marked_records_is_raised_from_the_next_batch(
    producer_db: str, db: Db, caplog: pytest.LogCaptureFixture
) -> None:
    """The database fails the consumer's own look (here its dead-letter table is gone): the
    error is logged and raised to the application waiting for a batch on a quiet stream."""
    async with Producer(producer_db) as producer:
        await publish(producer, b"1", POISON, b"3")
        async with Consumer(
            producer.address, "orders", db=db.url, name="ledger", on_failure=DeadLetter()
        ) as consumer:
            await consumer.apply(await anext(consumer), credit, db.insert)
            await asyncio.to_thread(db.execute, "DROP TABLE streamq_dead_letters")
            gone = (sqlite3.OperationalError, psycopg.errors.UndefinedTable)
            with pytest.raises(gone, match="streamq_dead_letters"):
                await asyncio.wait_for(anext(consumer), timeout=30)
    [logged] = [r for r in caplog.records if "marked for retry failed" in r.getMessage()]
    assert logged.levelname == "ERROR" and "consumer 'ledger'" in logged.getMessage()


# --- real processes ---------------------------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*STREAMQ, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "200"},  # rich's tables, unwrapped
    )


def run_consumer(
    address: str, url: str, target: int, *flags: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.consumer.test_poison", address, url, str(target), *flags],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
    )


def wait_for_head(address: str, head: int) -> None:
    deadline = time.monotonic() + 10
    while True:
        with contextlib.suppress(streamq.UnknownStreamError), streamq.Client(address) as client:
            if client.head("orders").head >= head:
                return
        assert time.monotonic() < deadline, f"orders never reached {head}"
        time.sleep(0.02)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """``streamq serve`` on a free port: (producer database, address)."""
    producer_db = str(tmp_path / "producer.db")
    process = subprocess.Popen(
        [*STREAMQ, "serve", producer_db, "--init", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert process.stdout is not None
        first = process.stdout.readline()
        assert first.startswith("serving producer"), first + process.stderr.read()
        yield producer_db, first.rsplit(" on ", 1)[1].strip()
    finally:
        process.terminate()
        process.communicate(timeout=30)


def test_kill_9_between_parking_and_commit_then_retry_from_the_cli(
    served: tuple[str, str], db: Db
) -> None:
    producer_db, address = served
    values = [b"poison" if n == 7 else b"%d" % n for n in range(1, 21)]
    published = run_cli("publish", producer_db, "orders", *(v.decode() for v in values))
    assert published.returncode == 0, published.stderr
    wait_for_head(address, 20)

    # Killed once the poison record is parked, its batch's other records being applied.
    killed = run_consumer(address, db.url, 20, "--kill-after-park")
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    assert "KILLING" in killed.stdout
    assert db.parked() == [] and db.credits() == [] and db.positions() == []

    done = run_consumer(address, db.url, 20)
    assert done.returncode == 0, done.stderr
    assert "DONE applied=20 parked=1 reapplied=0" in done.stdout
    expected = [n for n in range(1, 21) if n != 7]
    assert db.credits() == expected and db.parked() == [7] and db.positions() == [20]

    listed = run_cli("dead-letters", "list", db.url, "--json")
    assert listed.returncode == 0, listed.stderr
    (row,) = [json.loads(line) for line in listed.stdout.splitlines()]
    assert (row["consumer"], row["stream"], row["seq"], row["value"]) == (
        "ledger",
        "orders",
        7,
        "poison",
    )
    assert row["error"].endswith("ValueError: cannot apply b'poison'")
    assert row["retry_requested_at"] is None
    table = run_cli("dead-letters", "list", db.url)
    assert "ValueError: cannot apply" in table.stdout and "ledger" in table.stdout

    retry = run_cli("dead-letters", "retry", db.url, "--consumer", "ledger", "--seq", "7")
    assert retry.returncode == 0, retry.stderr
    assert "marked 1 record(s) for retry" in retry.stdout
    marked = run_cli("dead-letters", "list", db.url, "--json")
    assert json.loads(marked.stdout)["retry_requested_at"] is not None

    # The consumer, fixed, re-applies it before its next batch: once.
    assert run_cli("publish", producer_db, "orders", "21").returncode == 0
    wait_for_head(address, 21)
    fixed = run_consumer(address, db.url, 21, "--fixed")
    assert fixed.returncode == 0, fixed.stderr
    assert "DONE applied=21 parked=0 reapplied=1" in fixed.stdout
    assert db.credits() == [*expected, 7, 21] and db.parked() == [] and db.positions() == [21]
    again = run_cli("dead-letters", "retry", db.url)
    assert again.returncode == 1 and "no parked record matched" in again.stderr
    assert run_cli("dead-letters", "list", db.url, "--json").stdout == ""


# --- the consumer process -----------------------------------------------------------------


def credit_or_die(tx: Any, batch: Batch, insert: str, fixed: bool, kill_after_park: bool) -> int:
    """``credit``; with ``kill_after_park``, kill -9 this process as soon as a record is
    parked in this transaction, before it commits."""
    if kill_after_park:
        (parked,) = tx.execute("SELECT count(*) FROM streamq_dead_letters").fetchone()
        if parked:
            print("KILLING", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    return credit(tx, batch, insert, None if fixed else POISON)


async def consume(args: argparse.Namespace) -> int:
    create_effects(args.db)
    engine = "postgres" if is_postgres_url(args.db) else "sqlite"
    consumer = Consumer(
        args.address,
        "orders",
        db=args.db,
        name="ledger",
        on_failure=DeadLetter(),
        reconnect_timeout=30,
    )
    await consumer.start()
    try:
        insert = Db(engine, args.db).insert
        if consumer.applied < args.target:
            async for batch in consumer:
                await consumer.apply(batch, credit_or_die, insert, args.fixed, args.kill_after_park)
                if consumer.applied >= args.target:
                    break
        print(
            f"DONE applied={consumer.applied} parked={consumer.parked} "
            f"reapplied={consumer.reapplied}",
            flush=True,
        )
    finally:
        await consumer.close()
    return 0


if __name__ == "__main__":
    from streamq._loop import run

    parser = argparse.ArgumentParser()
    parser.add_argument("address")
    parser.add_argument("db")
    parser.add_argument("target", type=int)
    parser.add_argument("--fixed", action="store_true", help="the poison record applies")
    parser.add_argument("--kill-after-park", action="store_true")
    sys.exit(run(consume(parser.parse_args())))
