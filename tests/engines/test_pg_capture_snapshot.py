"""Capture with a snapshot (``Producer(url, capture=[...], snapshot=True)``, ``streamq serve
--capture ... --snapshot``): a table's rows as they were at one point of the WAL, then
its changes committed after that point, so that a consumer rebuilds the table exactly.
On a real server started with ``wal_level = logical``, writers committing throughout."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import psycopg
import pytest

from streamq import Consumer, Producer
from streamq.captured import decode_change

from ..conftest import wait_for
from .test_pg_capture import ORDERS, changes, sql

FULL_ROW = (
    "'first', 12.50, '2026-12-01 17:00:00.25+01', '{\"a\": [1, null]}', '{x,\"y z\"}', "
    "'\\x00ff', 9007199254740993, true, '1 mon 2 days', 0.1"
)


async def test_a_snapshot_gives_the_rows_first_as_the_changes_give_them(capture_url: str) -> None:
    sql(
        capture_url,
        ORDERS,
        f"INSERT INTO orders VALUES (1, {FULL_ROW})",
        "INSERT INTO orders (id) VALUES (2)",  # NULLs
    )
    async with Producer(capture_url, capture=["orders"], snapshot=True) as producer:
        await changes(producer.address, "public.orders", 2)  # the snapshot is taken
        sql(capture_url, f"INSERT INTO orders VALUES (3, {FULL_ROW})")
        sql(capture_url, "UPDATE orders SET note = 'changed' WHERE id = 2")
        got = await changes(producer.address, "public.orders", 4)
    assert [(r.seq, c["op"], r.key) for r, c in got] == [
        (1, "snapshot", b'{"id":1}'),
        (2, "snapshot", b'{"id":2}'),
        (3, "insert", b'{"id":3}'),
        (4, "update", b'{"id":2}'),
    ]
    (_, first), (_, second), (_, inserted), (_, updated) = got
    assert first["new"] == {**inserted["new"], "id": 1}  # every type read alike
    assert second["new"] == {**updated["new"], "note": None}
    assert first["old"] is None and first["xid"] is None and first["table"] == "public.orders"
    assert [(c["index"], c["changes"]) for c in (first, second)] == [(0, 2), (1, 2)]
    assert first["lsn"] == second["lsn"] < inserted["lsn"]  # the point it is consistent with
    assert first["commit_time"] == got[0][0].timestamp


async def test_a_snapshot_is_taken_once_per_table(capture_url: str) -> None:
    """Started again, a producer streams on; a table added to the capture gets its own
    snapshot, and one that was left out and comes back gets a new one."""
    sql(
        capture_url,
        "CREATE TABLE orders (id integer PRIMARY KEY)",
        "CREATE TABLE customers (id integer PRIMARY KEY)",
        "INSERT INTO orders VALUES (1)",
        "INSERT INTO customers VALUES (10)",
    )
    async with Producer(capture_url, capture=["orders"], snapshot=True) as producer:
        assert [c["op"] for _, c in await changes(producer.address, "public.orders", 1)] == [
            "snapshot"
        ]
    sql(capture_url, "INSERT INTO orders VALUES (2)")
    both = ["orders", "customers"]
    async with Producer(capture_url, capture=both, snapshot=True) as producer:
        await changes(producer.address, "public.customers", 1)  # the snapshot is taken
        sql(capture_url, "INSERT INTO orders VALUES (3)", "INSERT INTO customers VALUES (11)")
        orders = await changes(producer.address, "public.orders", 3)
        customers = await changes(producer.address, "public.customers", 2)
    assert [(c["op"], c["new"]["id"]) for _, c in orders] == [
        ("snapshot", 1),
        ("insert", 2),
        ("insert", 3),
    ]
    assert [(c["op"], c["new"]["id"]) for _, c in customers] == [("snapshot", 10), ("insert", 11)]
    async with Producer(capture_url, capture=["customers"], snapshot=True):
        pass  # orders is left out
    async with Producer(capture_url, capture=both, snapshot=True) as producer:
        orders = await changes(producer.address, "public.orders", 6)
    assert [(c["op"], c["new"]["id"]) for _, c in orders[3:]] == [
        ("snapshot", 1),
        ("snapshot", 2),
        ("snapshot", 3),
    ]


class Writer(threading.Thread):
    """Small transactions over ids 1..100: each sets a row's ``n`` to the next number of
    one counter (inserting or updating it) or deletes it, so that every row's ``n``
    only grows. Stops when told, or after ``limit`` transactions."""

    def __init__(self, url: str, limit: int = 20_000) -> None:
        super().__init__(daemon=True)
        self.url, self.limit = url, limit
        self.committed = 0
        self.stop = threading.Event()

    def run(self) -> None:
        rng = random.Random(7)
        counter = 0
        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self.stop.is_set() and self.committed < self.limit:
                with conn.transaction():
                    for _ in range(rng.randint(1, 3)):
                        key = rng.randint(1, 100)
                        if rng.random() < 0.15:
                            conn.execute("DELETE FROM orders WHERE id = %s", (key,))
                        else:
                            counter += 1
                            conn.execute(
                                "INSERT INTO orders VALUES (%s, %s) "
                                "ON CONFLICT (id) DO UPDATE SET n = EXCLUDED.n",
                                (key, counter),
                            )
                self.committed += 1


async def test_a_table_rebuilt_from_its_stream_is_the_table_though_writers_never_stopped(
    capture_url: str,
) -> None:
    """The snapshot is taken, and the capture starts, while a writer commits: applying
    the stream, each row's ``n`` only grows (no change from before the snapshot comes
    after it, none is lost), and the rebuilt table is the table."""
    sql(capture_url, "CREATE TABLE orders (id integer PRIMARY KEY, n bigint NOT NULL)")
    writer = Writer(capture_url)
    writer.start()
    try:
        await wait_for(lambda: writer.committed >= 200, 60, "the writer's first transactions")
        async with Producer(capture_url, capture=["orders"], snapshot=True) as producer:
            started = writer.committed
            await wait_for(lambda: writer.committed >= started + 1_000, 60, "changes meanwhile")
            writer.stop.set()
            writer.join(timeout=30)
            sql(capture_url, "INSERT INTO orders VALUES (0, -1)")  # the last one
            rows: dict[int, int] = {}
            ops: list[str] = []
            async with Consumer(producer.address, "public.orders") as consumer:
                async with asyncio.timeout(60):
                    async for batch in consumer:
                        for record in batch:
                            change = decode_change(record.value)
                            ops.append(change["op"])
                            _apply(rows, change)
                        if 0 in rows:
                            break
    finally:
        writer.stop.set()
        writer.join(timeout=30)
    with psycopg.connect(capture_url) as conn:
        table: dict[int, int] = dict(conn.execute("SELECT id, n FROM orders").fetchall())
    assert rows == table
    assert "snapshot" in ops and ops.index("insert") > len(ops) - ops[::-1].index("snapshot") - 1
    assert ops.count("update") > 100 and ops.count("delete") > 10


def _apply(rows: dict[int, int], change: dict[str, Any]) -> None:
    """One change to the rebuilt table, checking the row's ``n`` grows."""
    if change["op"] == "delete":
        del rows[change["old"]["id"]]
        return
    new = change["new"]
    before = rows.get(new["id"], -2)
    assert new["n"] > before, f"row {new['id']}: n {new['n']} after {before}: {change}"
    rows[new["id"]] = new["n"]


def test_a_snapshot_without_capture_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs capture="):
        Producer(str(tmp_path / "p.db"), snapshot=True)
    done = subprocess.run(
        [sys.executable, "-m", "streamq", "serve", str(tmp_path / "p.db"), "--snapshot"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "it needs --capture" in done.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("columns", "keys"),
    [
        ("id integer PRIMARY KEY", ["12", "-3", "2", "10", "-20", "1", "9", "11"]),
        (
            "a integer, b text, PRIMARY KEY (a, b)",
            ["10, 'b'", "2, 'a'", "-1, 'z'", "2, 'B'", "10, 'a'"],
        ),
        (
            "id uuid PRIMARY KEY",
            [f"'{n:08x}-0000-0000-0000-000000000000'" for n in (0x10, 0x9, 0xA0, 0x1)],
        ),
    ],
)
async def test_a_snapshot_gives_rows_in_primary_key_order_not_as_text(
    capture_url: str, columns: str, keys: list[str]
) -> None:
    """Keys that sort otherwise as text (numbers past 9, negative numbers, composite keys,
    uuids) come in the table's own order: the order PostgreSQL gives them in."""
    sql(capture_url, f"CREATE TABLE ordered ({columns})")
    sql(capture_url, *(f"INSERT INTO ordered VALUES ({key})" for key in keys))
    with psycopg.connect(capture_url) as conn:
        names = [c.name for c in conn.execute("SELECT * FROM ordered LIMIT 0").description or ()]
        texts = ", ".join(f"{n}::text" for n in names)
        # The table's own order (an unqualified name would be the text output column's).
        order = ", ".join(f"o.{n}" for n in names)
        query = f"SELECT {texts} FROM ordered AS o ORDER BY {order}"
        expected = [dict(zip(names, row, strict=True)) for row in conn.execute(query)]
    async with Producer(capture_url, capture=["ordered"], snapshot=True) as producer:
        got = await changes(producer.address, "public.ordered", len(keys))
    assert [c["op"] for _, c in got] == ["snapshot"] * len(keys)
    rows = [{name: str(c["new"][name]) for name in names} for _, c in got]
    assert rows == expected
