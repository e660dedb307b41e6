"""Tables as streams: ``Producer(url, capture=[...])`` publishes every committed change to
captured tables, read from PostgreSQL's WAL (a logical replication slot, ``pgoutput``),
against a real server started with ``wal_level = logical``. The decoder of pgoutput's
messages is pure, and checked against messages built from the manual's format."""

from __future__ import annotations

import asyncio
import json
import struct
import subprocess
import sys
import urllib.request
from typing import Any

import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st

import streamq
from streamq import CaptureError, Consumer, Producer
from streamq.captured import (
    HEADER,
    HEADER_VALUE,
    capture_streams,
    change_json,
    decode_change,
    json_default,
)
from streamq.engines.postgres import changes as changes_module
from streamq.engines.postgres import pgoutput
from streamq.engines.postgres.capture import slot_name
from streamq.engines.postgres.changes import table_of

from ..conftest import wait_for

# --- pgoutput messages, built as the manual describes them -----------------------------


def _string(text: str) -> bytes:
    return text.encode() + b"\0"


def _tuple(values: pgoutput.Tuple) -> bytes:
    out = struct.pack("!h", len(values))
    for value in values:
        if value is None:
            out += b"n"
        elif value is pgoutput.UNCHANGED:
            out += b"u"
        else:
            assert isinstance(value, bytes)
            out += b"t" + struct.pack("!i", len(value)) + value
    return out


def encode(message: pgoutput.Message) -> bytes:
    """``message`` in pgoutput's protocol version 1 (the test's own encoder)."""
    epoch = 946_684_800_000_000
    if isinstance(message, pgoutput.Begin):
        return b"B" + struct.pack(
            "!QqI", message.final_lsn, message.commit_time_us - epoch, message.xid
        )
    if isinstance(message, pgoutput.Commit):
        return b"C" + struct.pack(
            "!bQQq", 0, message.commit_lsn, message.end_lsn, message.commit_time_us - epoch
        )
    if isinstance(message, pgoutput.Relation):
        out = b"R" + struct.pack("!I", message.relation_id)
        out += _string(message.namespace) + _string(message.name)
        out += message.replica_identity.encode() + struct.pack("!h", len(message.columns))
        for c in message.columns:
            out += struct.pack("!b", int(c.key)) + _string(c.name)
            out += struct.pack("!Ii", c.type_oid, c.type_modifier)
        return out
    if isinstance(message, pgoutput.Insert):
        return b"I" + struct.pack("!I", message.relation_id) + b"N" + _tuple(message.new)
    if isinstance(message, pgoutput.Update):
        out = b"U" + struct.pack("!I", message.relation_id)
        if message.old is not None:
            assert message.old_kind is not None
            out += message.old_kind.encode() + _tuple(message.old)
        return out + b"N" + _tuple(message.new)
    if isinstance(message, pgoutput.Delete):
        return (
            b"D"
            + struct.pack("!I", message.relation_id)
            + message.old_kind.encode()
            + _tuple(message.old)
        )
    if isinstance(message, pgoutput.Truncate):
        options = int(message.cascade) | int(message.restart_identity) << 1
        ids = b"".join(struct.pack("!I", i) for i in message.relation_ids)
        return b"T" + struct.pack("!ib", len(message.relation_ids), options) + ids
    if isinstance(message, pgoutput.Origin):
        return b"O" + struct.pack("!Q", message.lsn) + _string(message.name)
    assert isinstance(message, pgoutput.Type)
    return (
        b"Y"
        + struct.pack("!I", message.type_oid)
        + _string(message.namespace)
        + _string(message.name)
    )


names = st.text(
    st.characters(min_codepoint=1, max_codepoint=0x10FFFF, exclude_categories=("Cs",)), max_size=12
)
u32, u64 = st.integers(0, 2**32 - 1), st.integers(0, 2**63 - 1)
times = st.integers(0, 2**62)
values = st.lists(
    st.one_of(st.none(), st.just(pgoutput.UNCHANGED), st.binary(max_size=20)), max_size=6
).map(tuple)
messages = st.one_of(
    st.builds(pgoutput.Begin, u64, times, u32),
    st.builds(pgoutput.Commit, u64, u64, times),
    st.builds(
        pgoutput.Relation,
        u32,
        names,
        names,
        st.sampled_from("dnfi"),
        st.lists(
            st.builds(pgoutput.Column, names, u32, st.integers(-1, 2**31 - 1), st.booleans()),
            max_size=5,
        ).map(tuple),
    ),
    st.builds(pgoutput.Insert, u32, values),
    st.builds(pgoutput.Update, u32, values, st.none(), st.none()),
    st.builds(pgoutput.Update, u32, values, values, st.just("K")),
    st.builds(pgoutput.Delete, u32, values, st.sampled_from("KO")),
    st.builds(
        pgoutput.Truncate, st.lists(u32, max_size=4).map(tuple), st.booleans(), st.booleans()
    ),
    st.builds(pgoutput.Origin, u64, names),
    st.builds(pgoutput.Type, u32, names, names),
)


@given(messages)
def test_pgoutput_messages_decode_and_cut_ones_are_decode_errors(message: pgoutput.Message) -> None:
    data = encode(message)
    assert pgoutput.decode(data) == message
    for end in range(len(data)):  # every cut: DecodeError, never another exception
        with pytest.raises(pgoutput.DecodeError):
            pgoutput.decode(data[:end])
    with pytest.raises(pgoutput.DecodeError):
        pgoutput.decode(data + b"\0")


def test_unknown_messages_are_decode_errors() -> None:
    with pytest.raises(pgoutput.DecodeError, match="unknown message type 'Z'"):
        pgoutput.decode(b"Z")
    with pytest.raises(pgoutput.DecodeError, match="kind 'b'"):  # binary: never asked for
        pgoutput.decode(b"I" + struct.pack("!I", 1) + b"N" + struct.pack("!h", 1) + b"b")
    assert pgoutput.format_lsn(pgoutput.parse_lsn("16/B374D848")) == "16/B374D848"


# A key column's PostgreSQL type (OID), and a value of it with its text form.
key_values = st.one_of(
    st.integers(-(2**63), 2**63 - 1).map(lambda v: (20, v, str(v).encode())),  # int8
    st.text().map(lambda v: (25, v, v.encode())),  # text: quotes, controls, any script
    st.booleans().map(lambda v: (16, v, b"t" if v else b"f")),
    st.floats(allow_nan=False).map(lambda v: (701, v, repr(v).encode())),  # float8
    st.binary(max_size=4).map(lambda v: (17, v, b"\\x" + v.hex().encode())),  # bytea
)


@given(st.lists(st.tuples(st.text(min_size=1), key_values), min_size=1, max_size=3))
def test_a_rows_key_is_the_json_the_encoder_writes(key: list[tuple[str, Any]]) -> None:
    """Keys of integers and text are written by ``_key`` itself, others by the encoder:
    the same bytes as ``json.dumps`` either way."""
    key = list(dict(key).items())  # each name once
    relation = pgoutput.Relation(
        1, "public", "t", "d", tuple(pgoutput.Column(n, oid, -1, True) for n, (oid, _, _) in key)
    )
    table = table_of(relation, {"public.t": "t"}, {})
    written = changes_module._key(table, tuple(text for _, (_, _, text) in key))
    expected = {name: value for name, (_, value, _) in key}
    dumped = json.dumps(expected, separators=(",", ":"), ensure_ascii=False, default=json_default)
    assert written == dumped.encode()


def test_captured_tables_are_named_as_postgresql_names_them() -> None:
    assert capture_streams(["orders", "sales.items"]) == {
        "public.orders": "public.orders",
        "sales.items": "sales.items",
    }
    assert capture_streams({"orders": "orders-changes"}) == {"public.orders": "orders-changes"}
    for bad in (["a.b.c"], ["drop table;"], [""], []):
        with pytest.raises(ValueError, match="capture: "):
            capture_streams(bad)
    with pytest.raises(ValueError, match="named twice"):
        capture_streams(["orders", "public.orders"])


# --- capture on a real server --------------------------------------------------------


def producer_status(address: str) -> dict[str, Any]:
    with streamq.Client(address) as client:
        return client.status()


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text: str = response.read().decode()
    return text


def sql(url: str, *statements: str, params: Any = None) -> None:
    """``statements`` in one transaction of the application's own."""
    with psycopg.connect(url) as conn:
        for statement in statements:
            conn.execute(statement, params if "%s" in statement else None)


async def changes(
    address: str, stream: str, count: int
) -> list[tuple[streamq.Record, dict[str, Any]]]:
    """The first ``count`` records of ``stream``, each with its change."""
    received: list[streamq.Record] = []
    async with Consumer(address, stream) as consumer:
        async with asyncio.timeout(30):
            async for batch in consumer:
                received += batch
                if len(received) >= count:
                    break
    assert all(r.headers == {HEADER: HEADER_VALUE} for r in received)
    return [(r, decode_change(r.value)) for r in received]


ORDERS = """CREATE TABLE orders (
    id integer PRIMARY KEY, note text, amount numeric(10, 2), at timestamptz, doc jsonb,
    tags text[], blob bytea, n bigint, ok boolean, span interval, ratio double precision)"""


async def test_every_operation_is_a_record_of_the_tables_stream_in_commit_order(
    capture_url: str,
) -> None:
    sql(capture_url, ORDERS)
    async with Producer(capture_url, capture=["orders"]) as producer:
        sql(
            capture_url,
            "INSERT INTO orders VALUES (1, 'first', 12.50, '2026-12-01 17:00:00.25+01', "
            "'{\"a\": [1, null]}', '{x,\"y z\"}', '\\x00ff', 9007199254740993, true, "
            "'1 mon 2 days', 0.1)",
            "INSERT INTO orders (id) VALUES (2)",  # NULLs
        )
        sql(capture_url, "UPDATE orders SET note = 'changed' WHERE id = 1")
        sql(capture_url, "UPDATE orders SET id = 3 WHERE id = 2")  # the key changes
        sql(capture_url, "DELETE FROM orders WHERE id = 1")
        got = await changes(producer.address, "public.orders", 5)
        assert producer.capture is not None and producer.capture.lsn > 0
    ops = [(r.seq, c["op"], r.key) for r, c in got]
    assert ops == [
        (1, "insert", b'{"id":1}'),
        (2, "insert", b'{"id":2}'),
        (3, "update", b'{"id":1}'),
        (4, "update", b'{"id":3}'),
        (5, "delete", b'{"id":1}'),
    ]
    first = got[0][1]
    assert first["table"] == "public.orders" and first["old"] is None
    assert first["new"] == {
        "id": 1,
        "note": "first",
        "amount": "12.50",
        "at": "2026-12-01T16:00:00.250000+00:00",
        "doc": {"a": [1, None]},
        "tags": ["x", "y z"],
        "blob": b"\x00\xff",
        "n": 9007199254740993,
        "ok": True,
        "span": "1 mon 2 days",
        "ratio": 0.1,
    }
    assert got[1][1]["new"] == {"id": 2, **dict.fromkeys(list(first["new"])[1:])}
    assert got[2][1]["new"]["note"] == "changed" and got[2][1]["old"] is None
    assert got[3][1]["old"] == {"id": 2}  # the key before
    assert got[4][1]["new"] is None and got[4][1]["old"] == {"id": 1}
    assert [c["xid"] for _, c in got[:2]] == [got[0][1]["xid"]] * 2  # one transaction
    assert [(c["index"], c["changes"]) for _, c in got] == [(0, 2), (1, 2), (0, 1), (0, 1), (0, 1)]
    lsns = [c["lsn"] for _, c in got]
    assert lsns[0] == lsns[1] < lsns[2] < lsns[3] < lsns[4]
    assert all(r.timestamp == c["commit_time"] for r, c in got)
    assert '"blob":"00ff"' in change_json(got[0][0].value)


async def test_a_transaction_over_two_tables_can_be_regrouped(capture_url: str) -> None:
    """Each table is its stream; a transaction's changes carry its xid and LSN, their
    place in it and how many it made, over both streams."""
    sql(
        capture_url,
        "CREATE TABLE customers (id integer PRIMARY KEY, name text)",
        "CREATE TABLE orders (id integer PRIMARY KEY, customer integer)",
    )
    streams = {"customers": "customer-changes", "orders": "order-changes"}
    async with Producer(capture_url, capture=streams) as producer:
        sql(
            capture_url,
            "INSERT INTO customers VALUES (7, 'Ada')",
            "INSERT INTO orders VALUES (1, 7)",
            "INSERT INTO orders VALUES (2, 7)",
            "UPDATE customers SET name = 'Ada L.' WHERE id = 7",
        )
        customers = await changes(producer.address, "customer-changes", 2)
        orders = await changes(producer.address, "order-changes", 2)
    every = sorted([c for _, c in customers + orders], key=lambda c: c["index"])
    assert {(c["xid"], c["lsn"], c["changes"]) for c in every} == {
        (every[0]["xid"], every[0]["lsn"], 4)
    }
    assert [(c["table"], c["op"]) for c in every] == [
        ("public.customers", "insert"),
        ("public.orders", "insert"),
        ("public.orders", "insert"),
        ("public.customers", "update"),
    ]


async def test_toasted_values_left_unchanged_and_full_replica_identity(capture_url: str) -> None:
    """An update that leaves a value stored out of line (TOAST) does not carry it: the
    column is named in ``unchanged``. With REPLICA IDENTITY FULL, an update and a delete
    carry the whole old row; a truncate is a record too."""
    sql(
        capture_url,
        "CREATE TABLE docs (id integer PRIMARY KEY, body text, n integer)",
        "ALTER TABLE docs ALTER COLUMN body SET STORAGE EXTERNAL",  # out of line, uncompressed
        "CREATE TABLE audit (at integer, what text)",  # no primary key
        "ALTER TABLE audit REPLICA IDENTITY FULL",
    )
    big = "x" * 10_000
    async with Producer(capture_url, capture=["docs", "audit"]) as producer:
        sql(capture_url, "INSERT INTO docs VALUES (1, %s, 0)", params=(big,))
        sql(capture_url, "UPDATE docs SET n = 1")
        sql(capture_url, "INSERT INTO audit VALUES (1, 'a')")
        sql(capture_url, "UPDATE audit SET what = 'b'")
        sql(capture_url, "DELETE FROM audit")
        sql(capture_url, "TRUNCATE docs")
        docs = await changes(producer.address, "public.docs", 3)
        audit = await changes(producer.address, "public.audit", 3)
    assert docs[0][1]["new"]["body"] == big
    assert docs[1][1]["new"] == {"id": 1, "n": 1} and docs[1][1]["unchanged"] == ["body"]
    assert (docs[2][1]["op"], docs[2][0].key, docs[2][1]["new"]) == ("truncate", None, None)
    assert [c["op"] for _, c in audit] == ["insert", "update", "delete"]
    assert audit[1][1]["old"] == {"at": 1, "what": "a"}
    assert audit[2][1]["old"] == {"at": 1, "what": "b"}
    assert audit[0][0].key == b'{"at":1,"what":"a"}'  # no primary key: the identity's columns


async def test_capture_and_publish_side_by_side(capture_url: str) -> None:
    sql(capture_url, "CREATE TABLE orders (id integer PRIMARY KEY)")
    async with Producer(capture_url, capture=["orders"]) as producer:
        for i in range(1, 4):
            async with producer.transaction() as tx:
                await tx.execute("INSERT INTO orders VALUES (%s)", (i,))
                await tx.publish("events", f"order {i}".encode())
        captured = await changes(producer.address, "public.orders", 3)
        published = await changes_plain(producer.address, "events", 3)
    assert [c["new"] for _, c in captured] == [{"id": 1}, {"id": 2}, {"id": 3}]
    assert published == [b"order 1", b"order 2", b"order 3"]


async def changes_plain(address: str, stream: str, count: int) -> list[bytes]:
    received: list[bytes] = []
    async with Consumer(address, stream) as consumer:
        async with asyncio.timeout(30):
            async for batch in consumer:
                received += [r.value for r in batch]
                if len(received) >= count:
                    return received
    return received


async def test_a_slot_read_again_publishes_nothing_twice(capture_url: str) -> None:
    """The slot moves only after what it gave is stored, and a slot behind what is stored
    (a crash before it moved, or a server crash that took its position back) gives
    again transactions already published: they are skipped, and what follows is not."""
    sql(capture_url, "CREATE TABLE orders (id integer PRIMARY KEY)")
    async with Producer(capture_url, capture=["orders"]) as producer:
        slot = slot_name(producer.producer_id)
        sql(capture_url, f"SELECT pg_copy_logical_replication_slot('{slot}', 'behind')")
        for i in range(1, 6):
            sql(capture_url, "INSERT INTO orders VALUES (%s)", params=(i,))
        assert len(await changes(producer.address, "public.orders", 5)) == 5
    sql(capture_url, "INSERT INTO orders VALUES (6)")  # while no producer runs
    with psycopg.connect(capture_url, autocommit=True) as conn:  # the slot as it was
        conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
        conn.execute("SELECT pg_copy_logical_replication_slot('behind', %s)", (slot,))
        conn.execute("SELECT pg_drop_replication_slot('behind')")
    async with Producer(capture_url, capture=["orders"]) as producer:
        sql(capture_url, "INSERT INTO orders VALUES (7)")
        got = await changes(producer.address, "public.orders", 7)
    assert [(r.seq, c["new"]["id"]) for r, c in got] == [(i, i) for i in range(1, 8)]


async def test_capture_needs_wal_level_logical(pg_url: str) -> None:
    sql(pg_url, "CREATE TABLE orders (id integer PRIMARY KEY)")
    with pytest.raises(CaptureError, match=r"wal_level = logical.*'replica'.*ALTER SYSTEM"):
        async with Producer(pg_url, capture=["orders"]):
            pass


async def test_tables_that_cannot_be_captured_are_refused_naming_them(capture_url: str) -> None:
    sql(capture_url, "CREATE TABLE log (line text)")
    with pytest.raises(
        CaptureError, match=r"public.log: it has no primary key.*REPLICA IDENTITY FULL"
    ):
        async with Producer(capture_url, capture=["log"]):
            pass
    with pytest.raises(CaptureError, match=r"public.nothere: no such table"):
        async with Producer(capture_url, capture=["nothere"]):
            pass
    with pytest.raises(ValueError, match="needs a PostgreSQL database"):
        Producer("orders.db", capture=["orders"])


async def test_capture_needs_the_replication_attribute(capture_url: str) -> None:
    sql(capture_url, "CREATE TABLE orders (id integer PRIMARY KEY)")
    with psycopg.connect(capture_url, autocommit=True) as conn:
        conn.execute("DROP ROLE IF EXISTS plain_app")
        conn.execute("CREATE ROLE plain_app LOGIN")
        conn.execute("GRANT ALL ON SCHEMA public TO plain_app")
        conn.execute("ALTER TABLE orders OWNER TO plain_app")
    url = capture_url.replace("streamq@", "plain_app@")
    try:
        with pytest.raises(
            CaptureError, match=r"role 'plain_app' lacks it.*ALTER ROLE plain_app REPLICATION"
        ):
            async with Producer(url, capture=["orders"]):
                pass
    finally:
        with psycopg.connect(capture_url, autocommit=True) as conn:
            conn.execute("DROP OWNED BY plain_app")
            conn.execute("DROP ROLE plain_app")


async def test_columns_added_and_dropped_mid_stream_show_in_the_next_changes(
    capture_url: str,
) -> None:
    """No schema registry: each change carries its row as the table was when it
    committed, so a column added shows from the first change after it, and one dropped
    is gone from the next."""
    sql(capture_url, "CREATE TABLE orders (id integer PRIMARY KEY, note text)")
    async with Producer(capture_url, capture=["orders"]) as producer:
        sql(capture_url, "INSERT INTO orders VALUES (1, 'a')")
        sql(
            capture_url,
            "ALTER TABLE orders ADD COLUMN total numeric DEFAULT 0",
            "INSERT INTO orders VALUES (2, 'b', 5.5)",
        )
        sql(capture_url, "UPDATE orders SET total = 1 WHERE id = 1")
        sql(capture_url, "ALTER TABLE orders DROP COLUMN note", "INSERT INTO orders VALUES (3, 7)")
        got = await changes(producer.address, "public.orders", 4)
    assert [c["new"] for _, c in got] == [
        {"id": 1, "note": "a"},
        {"id": 2, "note": "b", "total": "5.5"},
        {"id": 1, "note": "a", "total": "1"},
        {"id": 3, "total": "7"},
    ]


async def test_status_and_metrics_say_how_far_capture_is_and_the_wal_it_holds(
    capture_url: str,
) -> None:
    sql(capture_url, "CREATE TABLE orders (id integer PRIMARY KEY)")
    async with Producer(capture_url, capture=["orders"], metrics_port=0) as producer:
        sql(capture_url, "INSERT INTO orders SELECT generate_series(1, 50)")
        await changes(producer.address, "public.orders", 50)
        capture = producer.capture
        assert capture is not None
        await wait_for(lambda: capture.retained_bytes > 0, what="a look at the slot")
        status = await asyncio.to_thread(producer_status, producer.address)
        metrics = await asyncio.to_thread(scrape, producer.metrics_address)
    assert status["capture"]["slot"] == slot_name(producer.producer_id)
    assert status["capture"]["tables"] == {"public.orders": "public.orders"}
    assert status["capture"]["changes"] == 50
    assert pgoutput.parse_lsn(status["capture"]["lsn"]) == capture.lsn > 0
    assert 0 < status["capture"]["retained_wal_bytes"] < 64 << 20
    assert status["capture"]["columns"] == {
        "public.orders": [{"name": "id", "type": "int4", "array": False}]
    }
    assert "streamq_capture_changes_total 50.0" in metrics
    assert "streamq_capture_retained_wal_bytes " in metrics


async def test_a_table_left_out_of_the_capture_is_left_out_of_its_older_wal_too(
    capture_url: str,
) -> None:
    """The WAL written while a table was captured still holds it in the publication as
    decoded then: once the capture drops it, its changes there are skipped, the other
    tables' captured."""
    sql(
        capture_url,
        "CREATE TABLE a (id integer PRIMARY KEY)",
        "CREATE TABLE b (id integer PRIMARY KEY)",
    )
    async with Producer(capture_url, capture=["a", "b"]):
        pass
    sql(capture_url, "INSERT INTO a VALUES (1)", "INSERT INTO b VALUES (1)")
    async with Producer(capture_url, capture=["a"]) as producer:
        sql(capture_url, "INSERT INTO a VALUES (2)", "INSERT INTO b VALUES (2)")
        got = await changes(producer.address, "public.a", 2)
        assert producer.head("public.b") == 0
    assert [(c["new"], c["changes"]) for _, c in got] == [({"id": 1}, 1), ({"id": 2}, 1)]


def test_the_command_line_captures_tails_changes_as_json_and_says_how_far(
    capture_url: str,
) -> None:
    """``streamq init --capture`` makes the slot and publication, ``streamq serve
    --capture`` captures, ``streamq tail`` shows a change as JSON, ``streamq status``
    says what is captured; a bad table name is one line."""
    sql(capture_url, "CREATE TABLE orders (id integer PRIMARY KEY, blob bytea)")
    init = run_cli("init", capture_url, "--capture", "orders")
    assert "capturing public.orders -> public.orders: slot and publication streamq_" in init
    serving = subprocess.Popen(
        [*STREAMQ, "serve", capture_url, "--port", "0", "--capture", "orders"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert serving.stdout is not None
        address = serving.stdout.readline().rsplit(" on ", 1)[1].strip()
        sql(capture_url, "INSERT INTO orders VALUES (1, '\\xff'), (2, NULL)")
        tailed = run_cli("tail", address, "public.orders", "--from", "1", "--count", "2", "--json")
        first, second = (json.loads(line) for line in tailed.splitlines())
        assert first["key"] == '{"id":1}' and first["value"]["new"] == {"id": 1, "blob": "ff"}
        assert second["value"]["op"] == "insert" and second["value"]["changes"] == 2
        plain = run_cli("tail", address, "public.orders", "--from", "2", "--count", "1")
        assert plain.split("\t")[-1].startswith('{"op":"insert","table":"public.orders"')
        status = run_cli("status", address)
        assert "capturing public.orders (slot streamq_" in status and "2 change(s)" in status
    finally:
        serving.terminate()
        serving.wait(timeout=30)
        serving.stdout.close()  # type: ignore[union-attr]
    bad = subprocess.run(
        [*STREAMQ, "serve", capture_url, "--capture", "orders;drop"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "capture: not a table name" in bad.stderr
    assert "Traceback" not in bad.stderr


STREAMQ = [sys.executable, "-m", "streamq"]


def run_cli(*args: str) -> str:
    done = subprocess.run([*STREAMQ, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout
