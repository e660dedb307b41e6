"""Records encoded elsewhere (``records.Unnumbered``: a Spark executor encodes them, the
driver appends them) through the application's connection to either engine
(``Engine.append_unnumbered``): stored as they are, then served, read by key and sought
by time exactly as the same records published through ``Engine.append``."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import Iterator
from typing import Any

import pytest

import streamq
from streamq.engines import for_connection, is_postgres_url
from streamq.engines.sqlite.storage import BATCH_RECORDS, SEQ_BITS
from streamq.protocol import UNNUMBERED_PREFIX
from streamq.records import DEFAULT_MAX_RECORD_SIZE, CheckedRecord, Unnumbered

Row = tuple[int, int, bytes | None, bytes, dict[str, bytes]]  # seq, ts, key, value, headers


@pytest.fixture
def producer_db(either_producer_db: str) -> str:
    return either_producer_db


def some_records() -> list[CheckedRecord]:
    """A run of one timestamp longer than two log rows hold, then timestamps that rise,
    repeat and fall, keyed records among unkeyed ones; headers on some."""
    records: list[CheckedRecord] = []
    for i in range(2_600):
        ts = 1_000 if i < 2_100 else (900 if i % 50 == 0 else 1_000 + i % 7)
        key = b"k%d" % (i % 5) if i >= 2_100 and i % 3 == 0 else None
        headers = {"n": b"%d" % i} if i % 4 == 0 else {}
        records.append((b"v%d" % i, key, headers, ts))
    return records


@contextlib.contextmanager
def transaction(db: str) -> Iterator[Any]:
    """The application's own connection to ``db``, in a transaction committed at the end."""
    if is_postgres_url(db):
        import psycopg

        with psycopg.connect(db) as pg:
            yield pg
        return
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        yield conn
        conn.execute("COMMIT")
    finally:
        conn.close()


def served(db: str, stream: str, count: int) -> tuple[list[Row], list[streamq.Record]]:
    """Every record of ``stream`` as a producer serving ``db`` pushes them to a consumer,
    and those of key ``k1`` as ``history`` finds them."""
    with streamq.SyncProducer(db, host="127.0.0.1", port=0) as producer:
        records = asyncio.run(asyncio.wait_for(received(producer.address, stream, count), 30))
        keyed = producer.history(stream, b"k1")
    return [(r.seq, r.timestamp, r.key, r.value, r.headers) for r in records], keyed


async def received(address: str, stream: str, until: int) -> list[streamq.Record]:
    records: list[streamq.Record] = []
    async with streamq.Consumer(address, stream) as consumer:
        async for batch in consumer:
            records += batch
            if batch.last_seq >= until:
                break
    return records


def test_records_encoded_elsewhere_are_served_as_the_same_records_published(
    producer_db: str,
) -> None:
    with streamq.SyncProducer(producer_db, serve=False) as producer:
        producer.create_stream("encoded", key_index=True)
        producer.create_stream("published", key_index=True)
    records = some_records()
    with transaction(producer_db) as conn:
        engine, dbapi = for_connection(conn)
        engine.append_unnumbered(dbapi, "encoded", Unnumbered.of(records, DEFAULT_MAX_RECORD_SIZE))
        engine.append(dbapi, "published", records, max_record_size=DEFAULT_MAX_RECORD_SIZE)
    encoded, by_key = served(producer_db, "encoded", len(records))
    published, by_key_published = served(producer_db, "published", len(records))
    assert encoded == published
    assert [(seq, value) for seq, _, _, value, _ in encoded] == [
        (i + 1, value) for i, (value, *_) in enumerate(records)
    ]
    assert [r.seq for r in by_key] == [r.seq for r in by_key_published]
    assert by_key and {r.key for r in by_key} == {b"k1"}


def stored(db: str, stream: str) -> list[tuple[int, int, int, bool, bytes | None]]:
    """(last seq, count, ts, unnumbered, key) of each of ``stream``'s rows, in seq order."""
    with contextlib.closing(sqlite3.connect(db)) as conn:
        rows = conn.execute(
            "SELECT pos, count, ts, record, key FROM streamq_log WHERE pos >> ? = "
            "(SELECT id FROM streamq_streams WHERE name = ?) ORDER BY pos",
            (SEQ_BITS, stream),
        ).fetchall()
    mask = (1 << SEQ_BITS) - 1
    return [(p & mask, n, ts, r.startswith(UNNUMBERED_PREFIX), k) for p, n, ts, r, k in rows]


def time_index(db: str, stream: str) -> list[tuple[int, int]]:
    """(ts, first seq at or after it) of ``stream``'s time index."""
    with contextlib.closing(sqlite3.connect(db)) as conn:
        rows = conn.execute(
            "SELECT ts, pos FROM streamq_time WHERE stream_id = "
            "(SELECT id FROM streamq_streams WHERE name = ?) ORDER BY ts",
            (stream,),
        ).fetchall()
    return [(ts, pos & ((1 << SEQ_BITS) - 1)) for ts, pos in rows]


def test_sqlite_stores_them_unnumbered_in_rows_of_one_timestamp(tmp_path: Any) -> None:
    """Rows as the one-statement append writes them: runs of one timestamp up to a row's
    limit, a keyed record of a stream with a key index in a row of its own; their time
    index (the trigger's) the full path's."""
    db = str(tmp_path / "producer.db")
    with streamq.SyncProducer(db, serve=False) as producer:
        producer.create_stream("encoded", key_index=True)
        producer.create_stream("plain")
        producer.create_stream("published", key_index=True)
    records = some_records()
    with transaction(db) as conn:
        engine, dbapi = for_connection(conn)
        for stream in ("encoded", "plain"):
            unnumbered = Unnumbered.of(records, DEFAULT_MAX_RECORD_SIZE)
            assert engine.append_unnumbered(dbapi, stream, unnumbered) == range(1, 2_601)
        engine.append(dbapi, "published", records, max_record_size=DEFAULT_MAX_RECORD_SIZE)
    rows = stored(db, "encoded")
    assert rows[:5] == [
        (1024, 1024, 1000, True, None),
        (2048, 1024, 1000, True, None),
        (2100, 52, 1000, True, None),
        (2101, 1, 900, True, b"k0"),  # keyed: a row of its own, with its key
        (2102, 1, 1001, True, None),  # the next timestamp: a row of its own
    ]
    assert sum(n for _, n, *_ in rows) == 2_600
    assert max(n for _, n, *_ in stored(db, "plain")) == BATCH_RECORDS  # no key index:
    assert all(key is None for *_, key in stored(db, "plain"))  # keys only in the records
    assert time_index(db, "encoded") == time_index(db, "published") == time_index(db, "plain")
