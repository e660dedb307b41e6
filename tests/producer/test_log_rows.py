"""The SQLite log's rows: a transaction's records of a stream share one row (storage.py,
``streamq_log``), and every read gives back exactly the records asked for, wherever a
range starts or ends inside a row."""

from __future__ import annotations

import contextlib
import sqlite3

import pytest
from hypothesis import given
from hypothesis import strategies as st

import streamq
from streamq import ConcurrentWriterError, Producer
from streamq.engines.sqlite.storage import BATCH_BYTES, BATCH_RECORDS, SEQ_BITS, pos
from streamq.producer.committed_log import take, take_runs
from streamq.protocol import decode_record, encode_record, split_records

from ..logsql import stored_seqs


def rows_of(path: str) -> list[tuple[int, int, int]]:
    """(stream id, last seq, count) of every row, in order."""
    with contextlib.closing(sqlite3.connect(path)) as db:
        rows = db.execute("SELECT pos, count FROM streamq_log ORDER BY pos").fetchall()
    return [(p >> SEQ_BITS, p & ((1 << SEQ_BITS) - 1), count) for p, count in rows]


async def test_a_transaction_writes_one_row_per_stream(producer_db: str) -> None:
    async with Producer(producer_db, serve=False) as producer:
        async with producer.transaction() as tx:
            await tx.publish_many("orders", [b"o%d" % i for i in range(100)])
            await tx.publish("audit", b"a")
            await tx.publish("orders", b"late")
        await producer.publish("orders", b"alone")
        orders, audit = producer.log.stream("orders").id, producer.log.stream("audit").id
    assert rows_of(producer_db) == [(orders, 101, 101), (orders, 102, 1), (audit, 1, 1)]
    assert stored_seqs(producer_db, orders) == list(range(1, 103))


async def test_every_range_reads_exactly_its_records(producer_db: str) -> None:
    """Rows of 1, 5 and 20 records; every (start, end) inside and across them, read from
    the database (no tail buffer)."""
    async with Producer(producer_db, serve=False, tail_bytes=0) as producer:
        for size in (1, 5, 20):
            async with producer.transaction() as tx:
                await tx.publish_many("orders", [b"v%d" % i for i in range(size)])
        stream = producer.log.stream("orders")
        assert [count for *_, count in rows_of(producer_db)] == [1, 5, 20]
        for start in range(1, 27):
            for end in range(start, 28):
                packed, last = await producer.log.read(stream, start, end, 1000, 1 << 20)
                seqs = [decode_record(record).seq for record in packed.records()]
                assert seqs == list(range(start, min(end, 27))), (start, end)
                assert last == min(end, 27) - 1
            packed, last = await producer.log.read(stream, start, 27, 3, 1 << 20)
            assert [decode_record(r).seq for r in packed.records()] == list(
                range(start, start + 3)
            )[: 27 - start]
        # Whole rows go out as stored, a part each; rows cut by the range, as one slice.
        packed, _ = await producer.log.read(stream, 1, 27, 1000, 1 << 20)
        assert (len(packed.parts), packed.count) == (3, 26)
        packed, last = await producer.log.read(stream, 4, 20, 1000, 1 << 20)
        assert (len(packed.parts), packed.count, last) == (2, 16, 19)


@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.lists(st.integers(1, 40), min_size=1, max_size=6)),
        min_size=1,
        max_size=6,
    ),
    st.integers(1, 12),
    st.integers(1, 150),
)
def test_taking_runs_takes_what_taking_their_records_would(
    shape: list[tuple[int, list[int]]], max_records: int, max_bytes: int
) -> None:
    """``take_runs`` (whole rows while they fit) gives the records ``take`` gives from the
    same records one by one: the same prefix, never less than one record."""
    runs, records, seq = [], [], 0
    for gap, value_sizes in shape:  # a gap: seqs compacted away between rows
        seq += gap
        encoded = [
            encode_record(seq + i + 1, 0, None, b"v" * n, {}) for i, n in enumerate(value_sizes)
        ]
        runs.append((seq + 1, len(encoded), b"".join(encoded)))
        records += [(seq + i + 1, e) for i, e in enumerate(encoded)]
        seq += len(encoded)
    expected = take([e for _, e in records], max_records, max_bytes)
    packed, last = take_runs(runs, max_records, max_bytes)
    assert list(packed.records()) == list(expected)
    assert packed.count == len(expected)
    assert last == records[len(expected) - 1][0]


async def test_consumers_resume_inside_a_row(producer_db: str) -> None:
    async with Producer(producer_db, tail_bytes=0) as producer:
        async with producer.transaction() as tx:
            await tx.publish_many("orders", [b"v%d" % i for i in range(50)])
        for start in (1, 2, 17, 49, 50):
            async with streamq.Consumer(producer.address, "orders", start_seq=start) as consumer:
                seqs: list[int] = []
                async for batch in consumer:
                    seqs += [record.seq for record in batch]
                    if batch.last_seq == 50:
                        break
            assert seqs == list(range(start, 51))


async def test_keyed_records_of_an_indexed_stream_keep_rows_of_their_own(
    producer_db: str,
) -> None:
    """The key index and compaction find records by row: a keyed record is one."""
    async with Producer(producer_db, serve=False) as producer:
        await producer.create_stream("accounts", key_index=True)
        async with producer.transaction() as tx:
            await tx.publish("accounts", b"1", key=b"k")
            await tx.publish_many("accounts", [b"2", b"3"])
            await tx.publish("accounts", b"4", key=b"j")
            await tx.publish("accounts", b"5", key=b"k")
        assert [count for *_, count in rows_of(producer_db)] == [1, 2, 1, 1]
        history = await producer.history("accounts", b"k")
        assert [(r.seq, r.value) for r in history] == [(1, b"1"), (5, b"5")]


async def test_rows_are_bounded_in_records_and_bytes(producer_db: str) -> None:
    big = BATCH_BYTES // 3
    async with Producer(producer_db, serve=False, flush_records=10 * BATCH_RECORDS) as producer:
        async with producer.transaction() as tx:
            await tx.publish_many("orders", [b"x"] * (2 * BATCH_RECORDS + 5))
        async with producer.transaction() as tx:
            await tx.publish_many("orders", [b"y" * big] * 5)
    counts = [count for *_, count in rows_of(producer_db)]
    assert counts == [BATCH_RECORDS, BATCH_RECORDS, 5, 2, 2, 1]
    with contextlib.closing(sqlite3.connect(producer_db)) as db:
        for count, record in db.execute("SELECT count, record FROM streamq_log"):
            assert len(record) <= BATCH_BYTES or count == 1
            assert len(split_records(record, count)) == count


async def test_a_seq_taken_inside_the_row_fails_the_transaction(producer_db: str) -> None:
    """The primary key sees a row's last seq only: the insert looks for the others."""
    async with Producer(producer_db, serve=False) as producer:
        await producer.publish("orders", b"first")
        stream_id = producer.log.stream("orders").id
        with pytest.raises(ConcurrentWriterError, match="another process appended"):
            async with producer.transaction() as tx:
                await tx.publish_many("orders", [b"a", b"b", b"c"])
                await tx.execute(  # what a tool writing the log by hand might do
                    "INSERT INTO streamq_log (pos, ts, record) VALUES (?, 0, x'c0')",
                    (pos(stream_id, 3),),
                )
        assert producer.head("orders") == 1
    assert stored_seqs(producer_db, stream_id) == [1]


async def test_a_version_2_database_is_migrated(producer_db: str) -> None:
    """Version 2 had a row per record and no ``count``: its rows read as before."""
    async with Producer(producer_db, serve=False) as producer:
        for value in (b"a", b"b", b"c"):
            await producer.publish("orders", value)
    with contextlib.closing(sqlite3.connect(producer_db)) as db, db:
        db.executescript(
            """
            ALTER TABLE streamq_log RENAME TO v3;
            CREATE TABLE streamq_log (
                pos INTEGER PRIMARY KEY, ts INTEGER NOT NULL, record BLOB NOT NULL, key BLOB);
            INSERT INTO streamq_log SELECT pos, ts, record, key FROM v3;
            DROP TABLE v3;
            UPDATE streamq_meta SET value = 2 WHERE key = 'schema_version';
            """
        )
    async with Producer(producer_db, tail_bytes=0) as producer:
        assert producer.head("orders") == 3
        async with producer.transaction() as tx:
            await tx.publish_many("orders", [b"d", b"e"])
        async with streamq.Consumer(producer.address, "orders") as consumer:
            values: list[bytes] = []
            async for batch in consumer:
                values += [record.value for record in batch]
                if batch.last_seq == 5:
                    break
    assert values == [b"a", b"b", b"c", b"d", b"e"]
    assert [count for *_, count in rows_of(producer_db)] == [1, 1, 1, 2]
