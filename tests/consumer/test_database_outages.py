"""A consumer's own database going away under it: its PostgreSQL server killed (``kill -9``
of the postmaster) or restarted (``pg_ctl restart -m fast``) mid-stream, SQLite's write
lock held by another connection past the busy timeout. The consumer waits for it
(``db_reconnect_timeout``) and goes on from its stored position, each record applied
once; past the bound it ends with one line naming the database."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest

import streamq
from streamq import Consumer, DatabaseUnavailableError, GroupConsumer, Producer
from streamq.engines.sqlite import storage as sqlite_storage

from ..conftest import started_server, wait_for
from ..oracle import (
    ADD_TO_SUM,
    APPLY_ROWS,
    POSTGRES,
    SQLITE,
    Dialect,
    History,
    amount,
    check,
    effect_schema,
    read_effects,
    read_log,
)
from ..pgserver import PostgresServer

STREAM = "orders"
KEYS = [b"account-%d" % n for n in range(16)]
_DATABASES = itertools.count(1)


@pytest.fixture(scope="module")
def own_postgres() -> Iterator[PostgresServer]:
    """A server of this module's own: its tests kill it and restart it."""
    yield from started_server()


@pytest.fixture
def new_database(own_postgres: PostgresServer) -> Iterator[Any]:
    """Makes fresh databases on ``own_postgres`` (with the oracle's effect tables); the
    server is running again after the test, whatever it did to it."""
    made: list[str] = []

    def make() -> str:
        name = f"billing_{next(_DATABASES)}"
        url = own_postgres.create_database(name)
        made.append(name)
        with POSTGRES.connect(url) as conn:
            for statement in effect_schema(POSTGRES):
                conn.execute(statement)
        return url

    yield make
    if not own_postgres.running:
        own_postgres.restart()
    for name in made:
        own_postgres.drop_database(name)


def effect(tx: streamq.BlockingSQL, batch: streamq.Batch, d: Dialect) -> int:
    """The oracle's effect: a row per record and a running sum (not idempotent)."""
    tx.executemany(d.sql(APPLY_ROWS), [(r.seq, r.value) for r in batch])
    tx.execute(d.sql(ADD_TO_SUM), (sum(amount(r.value) for r in batch),))
    return len(batch)


async def publish(producer: Producer, stop: asyncio.Event) -> None:
    """Small transactions, a few hundred records a second, until ``stop``."""
    n = 0
    while not stop.is_set():
        async with producer.transaction() as tx:
            for _ in range(5):
                n += 1
                await tx.publish(STREAM, b"r%d:%d" % (n, n % 7 + 1), key=KEYS[n % len(KEYS)])
        await asyncio.sleep(0.01)


async def apply_with_apply(consumer: Consumer) -> None:
    """The form that needs no handling of its own: ``apply`` runs ``effect`` again."""
    async for batch in consumer:
        await consumer.apply(batch, effect, POSTGRES)


async def apply_with_transaction(consumer: Consumer) -> None:
    """``transaction``: a block whose connection was lost is applied again, as the
    consumer's note on the error says (nothing of it committed)."""
    async for batch in consumer:
        for _ in range(100):
            try:
                async with consumer.transaction(batch) as tx:
                    rows = [(r.seq, r.value) for r in batch]
                    await tx.executemany(POSTGRES.sql(APPLY_ROWS), rows)
                    added = sum(amount(r.value) for r in batch)
                    await tx.execute(POSTGRES.sql(ADD_TO_SUM), (added,))
                break
            except psycopg.OperationalError as exc:
                assert "nothing of it committed; apply the batch again" in exc.__notes__[-1]


async def until(condition: Callable[[], bool], tasks: list[asyncio.Task[None]], what: str) -> None:
    """Wait for ``condition`` while ``tasks`` apply, looking every 50 ms for at most a
    minute; a task that ended raises its error here."""
    async with asyncio.timeout(60):
        while not (condition() or any(task.done() for task in tasks)):
            await asyncio.sleep(0.05)
    for task in tasks:
        if task.done():
            task.result()
            raise AssertionError("a consumer stopped by itself")


def assert_applied_once(producer_db: str, db: str, name: str = "billing") -> None:
    applied, position, total = read_effects(db, name, STREAM)
    history = History(
        committed=read_log(producer_db, STREAM),
        applied=applied,
        position=position,
        stored_sum=total,
        complete=True,
    )
    report = check(history)
    assert report.ok, str(report)
    assert report.records > 0


async def wind_down(
    stop: asyncio.Event,
    publishing: asyncio.Task[None],
    applying: list[asyncio.Task[None]],
    consumers: Sequence[Consumer | GroupConsumer],
) -> None:
    """The publisher stopped, the applying tasks cancelled, the consumers closed."""
    stop.set()
    await publishing
    for task in applying:
        task.cancel()
    await asyncio.gather(*applying, return_exceptions=True)
    for consumer in consumers:
        await consumer.close()


async def test_postgresql_killed_and_restarted_under_consumers_applying(
    tmp_path: Path, own_postgres: PostgresServer, new_database: Any
) -> None:
    """Three times: kill -9 of the postmaster or a fast restart, while two consumers
    apply (one by ``apply``, one by ``transaction``); neither is restarted by hand."""
    producer_db = str(tmp_path / "orders.db")
    by_apply, by_transaction = new_database(), new_database()
    stop = asyncio.Event()
    async with Producer(producer_db) as producer:
        publishing = asyncio.create_task(publish(producer, stop))
        options: dict[str, Any] = {"name": "billing", "db_reconnect_timeout": 60}
        consumers = [
            Consumer(producer.address, STREAM, db=by_apply, **options),
            Consumer(producer.address, STREAM, db=by_transaction, **options),
        ]
        applying: list[asyncio.Task[None]] = []
        try:
            for consumer in consumers:
                await consumer.start()
            applying += [
                asyncio.create_task(apply_with_apply(consumers[0])),
                asyncio.create_task(apply_with_transaction(consumers[1])),
            ]
            for cycle in range(4):
                since = min(c.applied for c in consumers) + 100
                await until(lambda: all(c.applied >= since for c in consumers), applying, "more")  # noqa: B023
                if cycle == 1:
                    await asyncio.to_thread(own_postgres.reconfigure)  # pg_ctl restart -m fast
                elif cycle < 3:
                    await asyncio.to_thread(own_postgres.kill)  # kill -9 of the postmaster
                    await asyncio.to_thread(own_postgres.restart)
            stop.set()
            await publishing
            head = producer.head(STREAM)
            await until(lambda: all(c.applied == head for c in consumers), applying, "the head")
        finally:
            await wind_down(stop, publishing, applying, consumers)
    for db in (by_apply, by_transaction):
        assert_applied_once(producer_db, db)


async def test_past_db_reconnect_timeout_the_consumer_ends_with_one_line(
    tmp_path: Path, own_postgres: PostgresServer, new_database: Any
) -> None:
    billing = new_database()
    async with Producer(str(tmp_path / "orders.db")) as producer:
        await producer.publish(STREAM, b"r1:1")
        async with Consumer(
            producer.address, STREAM, db=billing, name="billing", db_reconnect_timeout=1
        ) as consumer:
            batch = await anext(consumer)
            await consumer.apply(batch, effect, POSTGRES)
            await producer.publish(STREAM, b"r2:1")
            batch = await anext(consumer)
            await asyncio.to_thread(own_postgres.crash)  # every session ends with it
            with pytest.raises(DatabaseUnavailableError) as raised:
                await consumer.apply(batch, effect, POSTGRES)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(
        f"the consumer's PostgreSQL database {billing} could not be used for 1 s "
        "(db_reconnect_timeout): "
    ), message
    assert isinstance(raised.value, streamq.StreamQError)  # as `streamq` commands print it


async def test_a_group_goes_on_through_restarts_of_its_database(
    tmp_path: Path, own_postgres: PostgresServer, new_database: Any
) -> None:
    """Two members; the server killed, then restarted fast. Each member's shares apply
    through the outage, the members join again (their sessions' liveness locks are gone)
    and every record is applied once."""
    producer_db, db = str(tmp_path / "orders.db"), new_database()
    stop = asyncio.Event()
    options: dict[str, Any] = {
        "db": db,
        "name": "billing",
        "shares": 4,
        "lease_timeout": 2.0,
        "poll_interval": 0.1,
    }

    async def member(group: GroupConsumer) -> None:
        async for batch in group:
            with contextlib.suppress(streamq.LeaseLostError):  # its new holder applies it
                await group.apply(batch, group_effect)

    async with Producer(producer_db) as producer:
        publishing = asyncio.create_task(publish(producer, stop))
        groups = [GroupConsumer(producer.address, STREAM, **options) for _ in range(2)]
        applying: list[asyncio.Task[None]] = []
        try:
            for group in groups:
                await group.start()
            applying += [asyncio.create_task(member(group)) for group in groups]
            for cycle in range(3):
                since = len(rows(db)) + 200
                await until(lambda: len(rows(db)) >= since, applying, "more")  # noqa: B023
                if cycle == 0:
                    await asyncio.to_thread(own_postgres.kill)
                    await asyncio.to_thread(own_postgres.restart)
                elif cycle == 1:
                    await asyncio.to_thread(own_postgres.reconfigure)
            stop.set()
            await publishing
            head = producer.head(STREAM)
            await until(lambda: len(rows(db)) >= head, applying, "the head")
        finally:
            await wind_down(stop, publishing, applying, groups)
        committed = read_log(producer_db, STREAM)
    applied = rows(db)
    assert sorted(seq for seq, _ in applied) == sorted(committed)  # once each
    assert dict(applied) == committed


async def test_past_db_reconnect_timeout_a_group_ends_with_one_line(
    tmp_path: Path, own_postgres: PostgresServer, new_database: Any
) -> None:
    """A member applying its share and one standing by (it holds none: only the group's
    rows tell it the database is gone) both end with the one line."""
    db = new_database()
    options: dict[str, Any] = {"db": db, "name": "billing", "shares": 1}
    options.update(lease_timeout=1.0, poll_interval=0.1, db_reconnect_timeout=1)

    async def member(group: GroupConsumer) -> None:
        async for batch in group:
            await group.apply(batch, group_effect)

    async with Producer(str(tmp_path / "orders.db")) as producer:
        await producer.publish(STREAM, b"r1:1", key=KEYS[0])
        async with (
            GroupConsumer(producer.address, STREAM, **options) as first,
            GroupConsumer(producer.address, STREAM, **options) as second,
        ):
            await wait_for(lambda: first.held == [0] or second.held == [0], 10, "a holder")
            await asyncio.to_thread(own_postgres.crash)  # every session ends with it
            async with asyncio.timeout(20):
                ended = await asyncio.gather(member(first), member(second), return_exceptions=True)
    for error in ended:
        assert isinstance(error, DatabaseUnavailableError), repr(error)
        message = str(error)
        assert "\n" not in message
        assert message.startswith(
            f"the consumer's PostgreSQL database {db} could not be used for 1 s "
            "(db_reconnect_timeout): "
        ), message


def group_effect(tx: streamq.BlockingSQL, batch: streamq.Batch) -> None:
    tx.executemany(POSTGRES.sql(APPLY_ROWS), [(r.seq, r.value) for r in batch])


def rows(db: str) -> list[tuple[int, bytes]]:
    with POSTGRES.connect(db) as conn:
        return [(int(s), bytes(v)) for s, v in conn.execute("SELECT seq, value FROM applied")]


async def test_sqlite_locked_past_its_busy_timeout_is_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Another connection holds the consumer database's write lock longer than the busy
    timeout (made 0.1 s here), then lets go: the consumer applies on. Held past
    ``db_reconnect_timeout``: one line naming the file."""
    monkeypatch.setattr(sqlite_storage, "BUSY_TIMEOUT_MS", 100)
    producer_db, db = str(tmp_path / "orders.db"), str(tmp_path / "billing.db")
    with contextlib.closing(sqlite3.connect(db)) as conn:
        for statement in effect_schema(SQLITE):
            conn.execute(statement)
        conn.commit()
    holder = sqlite3.connect(db, isolation_level=None)
    caplog.set_level(logging.WARNING, "streamq.consumer")

    def waited() -> bool:
        return any("cannot be used" in record.getMessage() for record in caplog.records)

    async with Producer(producer_db) as producer:
        await producer.publish(STREAM, b"r1:1")
        async with Consumer(
            producer.address, STREAM, db=db, name="billing", db_reconnect_timeout=30
        ) as consumer:
            await consumer.apply(await anext(consumer), effect, SQLITE)
            for form in ("apply", "transaction"):
                holder.execute("BEGIN IMMEDIATE")  # the write lock
                head = await producer.publish(STREAM, b"r%d:2" % (consumer.applied + 1))
                batch = await anext(consumer)
                applying = asyncio.create_task(apply_sqlite(consumer, batch, form))
                await wait_for(waited, 10, "the consumer to find the database locked")
                assert not applying.done() and consumer.applied < head
                holder.execute("COMMIT")  # lets go
                async with asyncio.timeout(10):
                    await applying
                assert consumer.applied == head
                caplog.clear()
        async with Consumer(
            producer.address, STREAM, db=db, name="billing", db_reconnect_timeout=0.3
        ) as consumer:
            holder.execute("BEGIN IMMEDIATE")
            await producer.publish(STREAM, b"r4:1")
            batch = await anext(consumer)
            with pytest.raises(DatabaseUnavailableError) as raised:
                await consumer.apply(batch, effect, SQLITE)
            holder.execute("ROLLBACK")
            await consumer.apply(batch, effect, SQLITE)  # nothing of it had committed
    holder.close()
    assert str(raised.value) == (
        f"the consumer's SQLite database {db!r} could not be used for 0.3 s "
        "(db_reconnect_timeout): database is locked"
    )
    assert_applied_once(producer_db, db)


async def apply_sqlite(consumer: Consumer, batch: streamq.Batch, form: str) -> None:
    if form == "apply":
        await consumer.apply(batch, effect, SQLITE)
        return
    async with consumer.transaction(batch) as tx:
        await tx.executemany(APPLY_ROWS, [(r.seq, r.value) for r in batch])
        await tx.execute(ADD_TO_SUM, (sum(amount(r.value) for r in batch),))
