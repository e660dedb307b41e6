"""The WAL path (``engines/postgres/walpath.py``): on a server with ``wal_level = logical``,
``streamq.publish`` writes the records as a logical message in the writer's transaction,
and the serving producer numbers them from its own replication slot into the log, each
record stored once. The message format and its decoder are pure and checked without a
server; the rest against a real one."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import AsyncIterator, Iterator

import msgpack
import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st

import streamq
from bench.transfer_pg.kafka import drop_slot
from streamq import Consumer, Producer
from streamq.engines.postgres import pgoutput
from streamq.engines.postgres.walpath import (
    BadMessage,
    WalDecoder,
    publish_slot,
    read_message,
    widen,
)

from ..conftest import started_server, wait_for
from ..pgserver import PostgresServer
from .test_pg_capture import encode

# --- the messages, without a server ----------------------------------------------------


def message(content: bytes, lsn: int = 0x1_0000_0010, prefix: str = "streamq") -> bytes:
    """A pgoutput MESSAGE, as the manual's format gives it (transactional)."""
    return (
        b"M"
        + struct.pack("!bQ", 1, lsn)
        + prefix.encode()
        + b"\0"
        + struct.pack("!i", len(content))
        + content
    )


def test_a_logical_message_decodes_and_a_cut_one_is_an_error() -> None:
    data = message(b"payload")
    assert pgoutput.decode(data) == pgoutput.LogicalMessage(
        True, 0x1_0000_0010, "streamq", b"payload"
    )
    with pytest.raises(pgoutput.DecodeError):
        pgoutput.decode(data[:-1])


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"\xc1", "not a streamq message"),
        (msgpack.packb((2, "s", [1], [b"r"], [None])), "message version 2"),
        (msgpack.packb((1, "s", [1, 2], [b"r"], [None])), "do not match"),
    ],
)
def test_a_message_that_is_not_a_writers_is_refused_saying_why(content: bytes, reason: str) -> None:
    with pytest.raises(BadMessage, match=reason):
        read_message(content)


@given(st.integers(0, 2**62), st.integers(-(2**31) + 1, 2**31 - 1))
def test_a_32_bit_transaction_id_widens_to_its_xid8(xid8: int, apart: int) -> None:
    reference = max(0, xid8 + apart)  # a recent xid8, before or after it
    assert widen(xid8 & 0xFFFFFFFF, reference) == xid8
    assert widen(xid8, reference) == xid8  # an xid8 already is one


def test_the_decoder_gives_committed_transactions_with_their_records() -> None:
    """Messages of the ``streamq`` prefix and pending rows, in order, each with its id
    (a message's records at its LSN, LSN + 1, ...); other prefixes, and transactions
    holding nothing of streamq's, give nothing; a bad message is counted, not fatal."""
    columns = tuple(
        pgoutput.Column(name, 0, -1, False)
        for name in ("xid", "id", "stream", "ts", "record", "key")
    )
    relation = pgoutput.Relation(7, "public", "streamq_pending", "d", columns)
    ours = msgpack.packb((1, "orders", [5, 6], [b"a", b"b"], [b"k", None]))
    decoder = WalDecoder()
    feed = [
        pgoutput.Begin(100, 0, 42),
        relation,
        message(ours, lsn=1000),
        message(b"ignored", prefix="other"),
        pgoutput.Insert(7, (b"4294967338", b"3", b"orders", b"7", b"\\x63", None)),
        message(b"\xc1", lsn=2000),
    ]
    for item in feed:
        data = item if isinstance(item, bytes) else encode(item)
        assert decoder.feed(data) is None
        assert not decoder.between_transactions
    done = decoder.feed(encode(pgoutput.Commit(100, 120, 0)))
    assert done is not None and decoder.between_transactions
    assert (done.xid, done.end_lsn, done.pending) == (42, 120, [(4294967338, 3)])
    assert done.rows == [
        (42, 1000, "orders", 5, b"a", b"k"),
        (42, 1001, "orders", 6, b"b", None),
        (4294967338, 3, "orders", 7, b"c", None),
    ]
    assert decoder.bad == 1
    decoder.feed(encode(pgoutput.Begin(200, 0, 43)))
    assert decoder.feed(encode(pgoutput.Commit(200, 220, 0))) is None  # nothing of ours


# --- on a real server ------------------------------------------------------------------


async def serving_through_the_wal(producer: Producer) -> dict[str, object]:
    numberer = producer.numberer
    assert numberer is not None
    await wait_for(lambda: numberer.status()["path"] != "starting", what="a path chosen")
    return numberer.status()


async def received(address: str, stream: str, count: int) -> list[tuple[int, bytes]]:
    async with Consumer(address, stream) as consumer:
        got: list[tuple[int, bytes]] = []
        while len(got) < count:
            batch = await asyncio.wait_for(anext(consumer), 30)
            got += [(record.seq, record.value) for record in batch]
    return got


def count(url: str, table: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
    assert row is not None
    return int(row[0])


async def test_records_go_through_the_wal_once_in_commit_order(capture_url: str) -> None:
    """A record published before the slot existed (pending) comes first; then the
    others in the order their transactions committed, not the order they published;
    a rollback publishes nothing; nothing is left in the pending table, and the log
    holds each record once."""
    with psycopg.connect(capture_url) as conn:
        streamq.create_tables(conn)
        streamq.publish(conn, "orders", b"before")
    async with Producer(capture_url) as producer:
        status = await serving_through_the_wal(producer)
        assert status["path"] == "wal" and status["slot"] == publish_slot(producer.producer_id)
        await wait_for(lambda: producer.head("orders") == 1, what="the pending record numbered")
        with (
            psycopg.connect(capture_url) as first,
            psycopg.connect(capture_url) as second,
            psycopg.connect(capture_url) as third,
        ):
            late = streamq.publish(first, "orders", b"published first, committed second")
            streamq.publish(second, "orders", b"published second, committed first")
            second.commit()
            first.commit()
            streamq.publish(third, "orders", b"rolled back")
            third.rollback()
            many = streamq.publish_many(third, "orders", [b"m1", b"m2"])
            third.commit()
        got = await received(producer.address, "orders", 5)
        assert await producer.wait_served(late, timeout=10) == range(3, 4)
        assert await producer.wait_served(many, timeout=10) == range(4, 6)
        assert producer.server is not None
        assert producer.server.status()["publishing"]["path"] == "wal"
    assert got == [
        (1, b"before"),
        (2, b"published second, committed first"),
        (3, b"published first, committed second"),
        (4, b"m1"),
        (5, b"m2"),
    ]
    assert count(capture_url, "streamq_pending") == 0
    assert count(capture_url, "streamq_log") == 5


async def test_a_transaction_open_for_long_delays_only_its_own_records(capture_url: str) -> None:
    with psycopg.connect(capture_url) as conn:
        streamq.create_tables(conn)
    async with Producer(capture_url) as producer:
        await serving_through_the_wal(producer)
        await producer.create_stream("s")
        with psycopg.connect(capture_url) as slow, psycopg.connect(capture_url) as quick:
            streamq.publish(slow, "s", b"slow")
            streamq.publish(quick, "s", b"quick")
            quick.commit()
            assert await received(producer.address, "s", 1) == [(1, b"quick")]
            numberer = producer.numberer
            assert numberer is not None
            await wait_for(lambda: numberer.open_transactions.count >= 1, what="reported")
            slow.commit()
        assert await received(producer.address, "s", 2) == [(1, b"quick"), (2, b"slow")]


async def served_through_the_table(url: str, *reason: str) -> None:
    """A producer on ``url`` (its tables made) runs the table path, its status giving
    ``reason``, and serves what is published."""
    async with Producer(url) as producer:
        status = await serving_through_the_wal(producer)
        assert status["path"] == "table"
        assert all(part in str(status["reason"]) for part in reason), status
        await producer.create_stream("s")
        with psycopg.connect(url) as conn:
            streamq.publish(conn, "s", b"r")
        assert await received(producer.address, "s", 1) == [(1, b"r")]
    assert count(url, "streamq_pending") == 0


async def test_without_wal_level_logical_the_table_path_runs_and_says_why(pg_url: str) -> None:
    with psycopg.connect(pg_url) as conn:
        streamq.create_tables(conn)
    await served_through_the_table(pg_url, "wal_level is 'replica'")


@contextlib.asynccontextmanager
async def serving_one(url: str, value: bytes) -> AsyncIterator[tuple[Producer, str]]:
    """A producer serving ``url`` through the WAL, ``value`` published to stream "s" and
    received; the producer and its slot."""
    with psycopg.connect(url) as conn:
        streamq.create_tables(conn)
    async with Producer(url) as producer:
        assert (await serving_through_the_wal(producer))["path"] == "wal"
        await producer.create_stream("s")
        with psycopg.connect(url) as conn:
            streamq.publish(conn, "s", value)
        assert await received(producer.address, "s", 1) == [(1, value)]
        yield producer, publish_slot(producer.producer_id)


async def test_a_slot_dropped_under_it_is_said_and_made_again(
    capture_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Someone drops the slot (its reader cut off first): one error line naming it, the
    slot made again, and records published after that served on at the next seq."""
    async with serving_one(capture_url, b"one") as (producer, slot):
        with caplog.at_level(logging.INFO, "streamq.postgres"):

            def dropped() -> bool:
                with psycopg.connect(capture_url, autocommit=True) as admin:
                    admin.execute(
                        "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
                        "WHERE slot_name = %s AND active_pid IS NOT NULL",
                        (slot,),
                    )
                    try:
                        admin.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
                    except psycopg.errors.ObjectInUse:
                        return False  # its reader had not gone yet
                return True

            await wait_for(dropped, what="the slot dropped")
            await wait_for(
                lambda: any("was dropped" in r.getMessage() for r in caplog.records),
                timeout=30,
                what="the error line",
            )
            await wait_for(
                lambda: any("made on" in r.getMessage() for r in caplog.records),
                timeout=30,
                what="the slot made again",
            )
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and slot in errors[0], errors
        with psycopg.connect(capture_url) as conn:
            streamq.publish(conn, "s", b"two")
        assert await received(producer.address, "s", 2) == [(1, b"one"), (2, b"two")]


@pytest.fixture
def own_server() -> Iterator[PostgresServer]:
    """A logical server of the test's own, which it restarts or fills with WAL."""
    yield from started_server(
        {"wal_level": "logical", "max_replication_slots": "5", "max_slot_wal_keep_size": "1MB"}
    )


def slot_status(url: str, slot: str) -> str | None:
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT wal_status FROM pg_replication_slots WHERE slot_name = %s", (slot,)
        ).fetchone()
    return None if row is None else str(row[0])


async def test_a_server_restarted_with_wal_level_lowered_is_served_through_the_table(
    own_server: PostgresServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The documented way back: the slot dropped once numbered, wal_level lowered, the
    server restarted. Records published since go through the pending table, the next
    serving process says so once, and the stream goes on at the next seq."""
    url = own_server.create_database("lowered")
    async with serving_one(url, b"through the WAL") as (_, slot):
        pass
    drop_slot(url, slot)
    own_server.reconfigure(wal_level="replica")
    with psycopg.connect(url) as conn:
        streamq.publish(conn, "s", b"through the table")
    assert count(url, "streamq_pending") == 1
    with caplog.at_level(logging.INFO, "streamq.postgres"):
        async with Producer(url) as producer:
            status = await serving_through_the_wal(producer)
            assert status["path"] == "table" and "wal_level is 'replica'" in str(status["reason"])
            got = await received(producer.address, "s", 2)
    assert got == [(1, b"through the WAL"), (2, b"through the table")]
    said = [r.getMessage() for r in caplog.records if "through table" in r.getMessage()]
    assert len(said) == 1, said


async def test_a_slot_invalidated_while_nobody_served_is_said_and_made_again(
    own_server: PostgresServer, caplog: pytest.LogCaptureFixture
) -> None:
    """``max_slot_wal_keep_size`` exceeded while no process served: PostgreSQL
    invalidates the slot and recycles the WAL it held, with a record published through
    it. Writers then publish through the table; the next serving process names the slot
    and the position after which records may be lost, in one error line, makes a new
    slot and serves on at the next seq: nothing served wrong."""
    url = own_server.create_database("invalidated")
    async with serving_one(url, b"served") as (_, slot):
        pass
    with psycopg.connect(url) as conn:
        streamq.publish(conn, "s", b"in the WAL when it went")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE filler (x text)")
        for _ in range(20):  # bounded: 20 x 8 MiB of WAL at most
            if slot_status(url, slot) == "lost":
                break
            conn.execute(
                "INSERT INTO filler SELECT repeat('x', 1000) FROM generate_series(1, 8000)"
            )
            conn.execute("SELECT pg_switch_wal()")
            conn.execute("CHECKPOINT")
    assert slot_status(url, slot) == "lost"
    with psycopg.connect(url) as conn:
        streamq.publish(conn, "s", b"after")  # the slot is lost: through the table
    assert count(url, "streamq_pending") == 1
    with caplog.at_level(logging.INFO, "streamq.postgres"):
        async with Producer(url) as producer:
            await wait_for(lambda: slot_status(url, slot) not in (None, "lost"), 30, "a new slot")
            got = await received(producer.address, "s", 2)
    assert got == [(1, b"served"), (2, b"after")]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and slot in errors[0] and "invalidated" in errors[0], errors


async def test_a_savepoint_rolled_back_takes_its_records_with_it(capture_url: str) -> None:
    """Records published inside a savepoint that is rolled back are not published (a
    transactional message belongs to its subtransaction); the others in the same
    transaction are, at consecutive seqs."""
    async with serving_one(capture_url, b"first") as (producer, _):
        with psycopg.connect(capture_url) as conn:
            streamq.publish(conn, "s", b"before")  # the transaction the savepoints are in
            with pytest.raises(ZeroDivisionError), conn.transaction():
                streamq.publish(conn, "s", b"rolled back with its savepoint")
                raise ZeroDivisionError
            with conn.transaction():
                streamq.publish(conn, "s", b"kept with its savepoint")
            streamq.publish(conn, "s", b"after")
        got = await received(producer.address, "s", 4)
    assert got == [
        (1, b"first"),
        (2, b"before"),
        (3, b"kept with its savepoint"),
        (4, b"after"),
    ]


async def test_with_no_free_replication_slot_the_table_path_runs_and_says_why() -> None:
    """Every slot taken: the WAL path cannot start, so the table path runs (records are
    served), and status says which setting to raise."""
    settings = {"wal_level": "logical", "max_replication_slots": "1"}
    with contextlib.contextmanager(started_server)(settings) as server:
        url = server.create_database("full")
        with psycopg.connect(url) as conn:
            conn.execute("SELECT pg_create_logical_replication_slot('someone_elses', 'pgoutput')")
            conn.commit()
            streamq.create_tables(conn)
        await served_through_the_table(url, "max_replication_slots")


async def test_a_wal_path_that_cannot_be_set_up_leaves_the_table_path_numbering(
    capture_url: str,
) -> None:
    """The slot's publication refused (here by an event trigger, as a DDL policy or a
    missing privilege would): after a few tries the table path numbers, and status says
    what failed, rather than nothing being numbered."""
    with psycopg.connect(capture_url) as conn:
        streamq.create_tables(conn)
        conn.execute(
            "CREATE FUNCTION no_publications() RETURNS event_trigger LANGUAGE plpgsql AS "
            "$$ BEGIN RAISE EXCEPTION 'publications are not allowed here'; END $$"
        )
        conn.execute(
            "CREATE EVENT TRIGGER no_publications ON ddl_command_start "
            "WHEN TAG IN ('CREATE PUBLICATION') EXECUTE FUNCTION no_publications()"
        )
    await served_through_the_table(capture_url, "could not be set up", "not allowed here")
