"""A producer serving from PostgreSQL: ``Producer("postgresql://...")`` against a real
server (``tests/pgserver.py``). Business rows and records commit together, numbered by
the serving producer once committed; other processes' ``streamq.publish`` are served as
they commit (an idle producer woken by the doorbell's NOTIFY, not by polling);
one process serves a database; and retention, compaction, history, seeks, epochs and
registrations behave as they do on SQLite."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

import streamq
from streamq import Consumer, Producer
from streamq.engines.postgres import storage as postgres_storage
from streamq.engines.postgres.numbering import Numberer
from streamq.errors import AlreadyServedError, DatabaseOpenError
from streamq.producer.metrics import ProducerCollector

from ..conftest import started_server, wait_for
from ..pgserver import PostgresServer

STREAMQ = [sys.executable, "-m", "streamq"]


def values(batch: streamq.Batch) -> list[tuple[int, bytes]]:
    return [(record.seq, record.value) for record in batch]


async def consume(address: str, stream: str, count: int, **options: object) -> list[streamq.Record]:
    """The first ``count`` records of ``stream``, as a consumer receives them."""
    received: list[streamq.Record] = []
    async with Consumer(address, stream, **options) as consumer:  # type: ignore[arg-type]
        async with asyncio.timeout(20):
            async for batch in consumer:
                received += batch
                if len(received) >= count:
                    return received
    return received


async def test_business_rows_and_records_commit_together(pg_url: str) -> None:
    async with Producer(pg_url) as producer:
        async with producer.transaction() as tx:
            await tx.execute("CREATE TABLE stock (sku text PRIMARY KEY, n integer)")
            await tx.execute("INSERT INTO stock VALUES (%s, %s)", ("a1", 10))
        async with producer.transaction() as tx:
            await tx.execute("UPDATE stock SET n = n - 1 WHERE sku = %s", ("a1",))
            first = await tx.publish("orders", b"payload", key=b"a1")
            second = await tx.publish("orders", b"second")
        # Numbered after the commit, and served when the block ends.
        assert isinstance(first, streamq.Receipt) and isinstance(second, streamq.Receipt)
        assert (first.stream, first.xid, first.count) == ("orders", second.xid, 1)
        assert await producer.wait_served(first) == range(1, 2)
        assert await producer.wait_served(second) == range(2, 3)
        with pytest.raises(RuntimeError, match="boom"):
            async with producer.transaction() as tx:
                await tx.execute("UPDATE stock SET n = 0")
                rolled_back = await tx.publish("orders", b"rolled back")
                await tx.publish("new-stream", b"rolled back")
                raise RuntimeError("boom")
        with pytest.raises(TimeoutError):  # never numbered
            await producer.wait_served(rolled_back, timeout=0.2)  # type: ignore[arg-type]
        assert await producer.publish("orders", b"third") == 3
        assert producer.head("orders") == 3
        assert "new-stream" not in producer.log.streams
        received = await consume(producer.address, "orders", 3)
    assert [(r.seq, r.value) for r in received] == [(1, b"payload"), (2, b"second"), (3, b"third")]
    assert received[0].key == b"a1"
    with psycopg.connect(pg_url) as conn:
        assert conn.execute("SELECT n FROM stock").fetchone() == (9,)
        assert conn.execute("SELECT count(*) FROM streamq_streams WHERE name = 'new-stream'")
        assert conn.execute("SELECT count(*) FROM streamq_log").fetchone() == (3,)


async def test_other_processes_commits_are_served_without_polling(pg_url: str) -> None:
    """``streamq.publish`` on the application's own connection: an idle serving producer
    has armed the doorbell, and the first publish after it rings (NOTIFY). The fallback
    check is set to an hour, so only the doorbell can wake it within the test's
    timeout."""
    async with Producer(pg_url, watch_interval=3600) as producer:
        await producer.create_stream("orders")
        numberer = producer.numberer
        assert numberer is not None
        async with Consumer(producer.address, "orders") as consumer:
            with psycopg.connect(pg_url) as conn:
                for n in range(3):
                    await wait_for(lambda: numberer.armed, what="the numberer to go idle")
                    with conn.transaction():
                        streamq.publish(conn, "orders", b"app %d" % n)
                with conn.transaction():  # a rollback sends no notification, and no record
                    streamq.publish(conn, "orders", b"rolled back")
                    raise psycopg.Rollback()
            received: list[streamq.Record] = []
            async with asyncio.timeout(10):
                async for batch in consumer:
                    received += batch
                    if len(received) >= 3:
                        break
            assert [r.value for r in received] == [b"app 0", b"app 1", b"app 2"]
        # The producer's own next seq follows the application's.
        assert await producer.publish("orders", b"producer") == 4


async def test_producer_and_application_interleave_with_dense_seqs(pg_url: str) -> None:
    """The producer's transactions and the application's publishes, numbered by the
    serving producer: seqs stay dense, each record once, whoever writes."""
    async with Producer(pg_url) as producer:
        await producer.create_stream("orders")

        def application(count: int) -> list[streamq.Receipt]:
            with psycopg.connect(pg_url) as conn:
                receipts = []
                for n in range(count):
                    with conn.transaction():
                        receipt = streamq.publish(conn, "orders", b"app %d" % n)
                        assert isinstance(receipt, streamq.Receipt)
                        receipts.append(receipt)
                return receipts

        app = asyncio.create_task(asyncio.to_thread(application, 200))
        ours = [await producer.publish("orders", b"producer %d" % n) for n in range(200)]
        theirs = [(await producer.wait_served(r, timeout=20))[0] for r in await app]
        assert sorted(ours + theirs) == list(range(1, 401))  # type: ignore[operator]
        await wait_for(lambda: producer.head("orders") == 400, what="the head to reach 400")
        received = await consume(producer.address, "orders", 400)
    assert [r.seq for r in received] == list(range(1, 401))


async def test_one_process_serves_a_database(pg_url: str) -> None:
    async with Producer(pg_url) as first:
        with pytest.raises(AlreadyServedError, match=r"already served by 'streamq serve at"):
            async with Producer(pg_url):
                pass
        async with Producer(pg_url, serve=False) as writer:  # publishing needs no lock
            receipt = await writer.publish("orders", b"from a worker")
            assert isinstance(receipt, streamq.Receipt)
            with pytest.raises(RuntimeError, match="only the serving producer"):
                await writer.wait_served(receipt)
        assert await first.wait_served(receipt, timeout=20) == range(1, 2)
    async with Producer(pg_url):  # the lock went with the first one's session
        pass


async def test_restart_takes_a_new_epoch_and_keeps_the_log(pg_url: str) -> None:
    async with Producer(pg_url) as producer:
        first_epoch = producer.epoch
        producer_id = producer.producer_id
        await producer.publish("orders", b"a")
    async with Producer(pg_url) as producer:
        assert producer.producer_id == producer_id
        assert producer.epoch > first_epoch
        assert await producer.publish("orders", b"b") == 2
        assert producer.log.streams["orders"].epochs.epoch_of(1) == first_epoch
        assert producer.log.streams["orders"].epochs.epoch_of(2) == producer.epoch
        received = await consume(producer.address, "orders", 2)
    assert [r.value for r in received] == [b"a", b"b"]


async def test_history_seek_retention_and_compaction(pg_url: str) -> None:
    async with Producer(pg_url) as producer:
        await producer.create_stream("accounts", key_index=True, notify_compacted=True)
        before = int(time.time() * 1000)
        async with producer.transaction() as tx:
            for n in range(10):
                await tx.publish("accounts", b"v%d" % n, key=b"k%d" % (n % 3))
        history = await producer.history("accounts", b"k1")
        assert [r.value for r in history] == [b"v1", b"v4", b"v7"]
        assert await producer.seek_time("accounts", before) == 1
        assert await producer.seek_time("accounts", int(time.time() * 1000) + 60_000) == 11

        removed = await producer.compact("accounts")
        # Each key's latest record stays: k0 at 10, k1 at 8, k2 at 9.
        assert sorted(entry.old_seq for entry in removed) == [1, 2, 3, 4, 5, 6, 7]
        assert producer.head("accounts.compacted") == 7
        received = await consume(producer.address, "accounts", 3)
        assert [(r.seq, r.value) for r in received] == [(8, b"v7"), (9, b"v8"), (10, b"v9")]

        await producer.truncate("accounts", 9)
        with pytest.raises(streamq.OffsetOutOfRangeError):
            await consume(producer.address, "accounts", 1, start_seq=7)
        assert [r.value for r in await consume(producer.address, "accounts", 2, start_seq=9)] == [
            b"v8",
            b"v9",
        ]


async def test_registrations_are_stored_and_retention_counts_their_losses(pg_url: str) -> None:
    async with Producer(pg_url) as producer:
        await producer.register_consumer("ledger", "orders")
        async with producer.transaction() as tx:
            await tx.publish_many("orders", [b"x"] * 5)
        assert await producer.apply_retention() == []  # no cap: ledger's records are kept
        producer.set_retention("orders", ms=0)  # a cap forces them out, and says whose
        [truncation] = await producer.apply_retention()
        assert (truncation.low, truncation.deleted, truncation.lost) == (6, 5, {"ledger": 5})
        with psycopg.connect(pg_url) as conn:
            assert conn.execute("SELECT consumer, stream FROM streamq_consumers").fetchall() == [
                ("ledger", "orders")
            ]
        assert await producer.unregister_consumer("ledger", "orders")
        assert not await producer.unregister_consumer("ledger", "orders")
    with psycopg.connect(pg_url) as conn:
        assert conn.execute("SELECT count(*) FROM streamq_consumers").fetchone() == (0,)
        assert conn.execute("SELECT low FROM streamq_streams").fetchone() == (6,)


async def test_run_in_transaction_runs_on_a_worker_thread(pg_url: str) -> None:
    """``fn(tx)`` as one transaction on a connection of its own: the business row and
    the records commit together, a raise commits neither, and the records are served."""

    def debit_and_publish(tx: streamq.SyncTransaction, sku: str, count: int) -> streamq.Receipt:
        tx.execute("UPDATE stock SET n = n - %s WHERE sku = %s", (count, sku))
        receipt = tx.publish_many("orders", [sku.encode()] * count)
        assert isinstance(receipt, streamq.Receipt)
        if count > 5:
            raise ValueError("not that many")
        return receipt

    async with Producer(pg_url) as producer:
        async with producer.transaction() as tx:
            await tx.execute("CREATE TABLE stock (sku text PRIMARY KEY, n integer)")
            await tx.execute("INSERT INTO stock VALUES ('a1', 10)")
        receipt = await producer.run_in_transaction(debit_and_publish, "a1", 3)
        assert await producer.wait_served(receipt) == range(1, 4)  # served on return
        with pytest.raises(ValueError, match="not that many"):
            await producer.run_in_transaction(debit_and_publish, "a1", 6)
        assert await producer.publish("orders", b"after") == 4
        received = await consume(producer.address, "orders", 4)
        assert [r.value for r in received] == [b"a1", b"a1", b"a1", b"after"]
    with psycopg.connect(pg_url) as conn:
        assert conn.execute("SELECT n FROM stock").fetchone() == (7,)


async def test_refusals_name_what_is_missing(pg_url: str) -> None:
    bad = pg_url.rsplit("/", 1)[0] + "/no_such_database"
    with pytest.raises(DatabaseOpenError, match="no_such_database"):
        async with Producer(bad):
            pass


def test_sync_producer_on_postgresql(pg_url: str) -> None:
    """Transactions on the calling thread's own connection, from several threads: dense
    seqs, the business rows with them, the serving loop woken after each commit."""
    with streamq.SyncProducer(pg_url) as producer:
        with producer.transaction() as tx:
            tx.execute("CREATE TABLE stock (sku text PRIMARY KEY, n integer)")
            tx.execute("INSERT INTO stock VALUES (%s, %s)", ("a1", 100))

        def worker(n: int) -> list[int]:
            seqs = []
            for _ in range(20):
                with producer.transaction() as tx:
                    tx.execute("UPDATE stock SET n = n - 1 WHERE sku = %s", ("a1",))
                    receipt = tx.publish("orders", b"%d" % n)
                assert isinstance(receipt, streamq.Receipt)
                seqs += producer.wait_served(receipt)  # served when the block ended
            return seqs

        with ThreadPoolExecutor(4) as pool:
            seqs = [seq for batch in pool.map(worker, range(4)) for seq in batch]
        assert sorted(seqs) == list(range(1, 81))
        assert producer.head("orders") == 80
        assert producer.query("SELECT n FROM stock") == [(20,)]
        with pytest.raises(RuntimeError, match="boom"), producer.transaction() as tx:
            tx.publish("orders", b"rolled back")
            raise RuntimeError("boom")
        assert producer.publish("orders", b"last") == 81
        with streamq.Client(producer.address) as client:
            assert client.head("orders").head == 81


def test_cli_init_and_serve_a_postgresql_database(pg_url: str) -> None:
    init = subprocess.run(
        [*STREAMQ, "init", pg_url, "--stream", "orders"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert init.returncode == 0, init.stderr
    assert "streamq log tables ready" in init.stdout
    server = subprocess.Popen(
        [*STREAMQ, "serve", pg_url, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        first = server.stdout.readline()
        assert first.startswith("serving producer"), first + server.stderr.read()
        address = first.rsplit(" on ", 1)[1].strip()
        with psycopg.connect(pg_url) as conn, conn.transaction():
            streamq.publish(conn, "orders", b"from the application")
        deadline = time.monotonic() + 10
        with streamq.Client(address) as client:
            while client.head("orders").head < 1:
                assert time.monotonic() < deadline, "the server never saw the commit"
                time.sleep(0.01)
            [records] = list(client.read_range("orders", 1, 2))
            assert [r.value for r in records] == [b"from the application"]
    finally:
        server.terminate()
        server.communicate(timeout=30)
    assert server.returncode == 0
    refused = subprocess.run(
        [*STREAMQ, "serve", pg_url.rsplit("/", 1)[0] + "/missing", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert refused.returncode == 1
    assert "cannot open PostgreSQL database postgresql://" in refused.stderr
    assert 'database "missing" does not exist' in refused.stderr


@pytest.fixture
def own_server() -> Iterator[PostgresServer]:
    """A server of this test's own, since it is killed."""
    yield from started_server()


async def test_producer_survives_a_server_crash(own_server: PostgresServer) -> None:
    """kill -9 of PostgreSQL's postmaster, then a restart: the producer's writer and its
    LISTEN connection connect again, the records committed before are still served, and
    appends after the crash carry a new epoch (crash recovery emptied streamq_boot)."""
    url = own_server.create_database("shop")
    async with Producer(url, watch_interval=3600) as producer:
        assert await producer.publish("orders", b"before") == 1
        before = producer.log.streams["orders"].epochs.epoch_of(1)
        async with Consumer(producer.address, "orders") as consumer:
            assert values(await anext(consumer)) == [(1, b"before")]
            await asyncio.to_thread(own_server.kill)
            await asyncio.to_thread(own_server.restart)
            assert await producer.publish("orders", b"after") == 2
            assert values(await anext(consumer)) == [(2, b"after")]
            # Another process's commit wakes the server through the new LISTEN session
            # (the fallback check is an hour away).
            with psycopg.connect(url) as conn, conn.transaction():
                streamq.publish(conn, "orders", b"theirs")
            async with asyncio.timeout(10):
                assert values(await anext(consumer)) == [(3, b"theirs")]
        epochs = producer.log.streams["orders"].epochs
        assert epochs.epoch_of(2) == epochs.epoch_of(3) > before


async def test_history_seeks_and_time_seeks_use_indexes(pg_url: str) -> None:
    """One key's records and a time seek are index reads, whatever the stream's size: the
    plans PostgreSQL picks for the readers' statements (with enough rows that a scan
    would be costed)."""
    async with Producer(pg_url) as producer:
        await producer.create_stream("accounts", key_index=True)
        base = int(time.time() * 1000)
        async with producer.transaction() as tx:  # a time-index row per record
            for n in range(5000):
                await tx.publish("accounts", b"v", key=b"k%d" % (n % 500), timestamp=base + n)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("ANALYZE")

        def plan(sql: str, params: tuple[object, ...]) -> str:
            rows = conn.execute("EXPLAIN " + sql, params).fetchall()
            return "\n".join(row[0] for row in rows)

        history = plan(postgres_storage.KEY_RECORDS_QUERY, (1, b"k7", 1, 5001, 100))
        assert "streamq_log_key_seq" in history and "Sort" not in history, history
        seek = plan(postgres_storage.SEEK_TIME_QUERY, (1, 0))
        assert "Index" in seek and "Seq Scan" not in seek, seek


async def open_transactions(producer: Producer, count: int) -> bool:
    """Whether the producer's status and metrics report ``count`` open publishing
    transactions (and, if any, an age)."""

    def status() -> dict[str, int]:
        with streamq.Client(producer.address) as client:
            found: dict[str, int] = client.status()["open_transactions"]
        return found

    found = await asyncio.to_thread(status)
    metrics = {
        m.name: m.samples[0].value
        for m in ProducerCollector(producer).collect()
        if m.name.startswith("streamq_o")
    }
    aged = (found["oldest_age_ms"] > 0) == (count > 0)
    return (
        found["count"] == metrics["streamq_open_transactions"] == count
        and aged
        and (metrics["streamq_oldest_open_transaction_seconds"] > 0) == (count > 0)
    )


async def test_a_long_transaction_holds_back_nobody_and_loses_nothing(pg_url: str) -> None:
    """A transaction that published and stays open: others' records are numbered and
    served meanwhile, it is reported (status, metrics); its own come after them once it
    commits (commit order), and a transaction killed between its publish and its COMMIT
    leaves nothing."""
    async with Producer(pg_url) as producer:
        await producer.create_stream("orders")
        with psycopg.connect(pg_url) as long, psycopg.connect(pg_url) as other:
            long_receipt = streamq.publish(long, "orders", b"long")  # its transaction stays open
            for n in range(3):
                with other.transaction():
                    streamq.publish(other, "orders", b"other %d" % n)
            received = await consume(producer.address, "orders", 3)
            assert [r.value for r in received] == [b"other 0", b"other 1", b"other 2"]
            # Reported while open: in the status (streamq status) and the metrics.
            await wait_for(lambda: open_transactions(producer, 1), 20, "the open one reported")
            long.commit()
        assert isinstance(long_receipt, streamq.Receipt)
        assert await producer.wait_served(long_receipt, timeout=20) == range(4, 5)
        await wait_for(lambda: open_transactions(producer, 0), 20, "no open one reported")
        # A writer killed with its publish inserted and its COMMIT not sent.
        killed = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import os, sys, psycopg, streamq\n"
                "conn = psycopg.connect(sys.argv[1])\n"
                "streamq.publish(conn, 'orders', b'never committed')\n"
                "print('published', flush=True)\n"
                "os.kill(os.getpid(), 9)\n",
                pg_url,
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        with killed:
            assert killed.stdout is not None
            assert killed.stdout.readline() == "published\n"
            assert killed.wait(timeout=30) == -9
        assert await producer.publish("orders", b"after") == 5
        received = await consume(producer.address, "orders", 5)
    assert [r.value for r in received] == [
        b"other 0",
        b"other 1",
        b"other 2",
        b"long",
        b"after",
    ]
    with psycopg.connect(pg_url) as conn:
        # The killed writer's row went with its transaction; nothing is left to number.
        await wait_for(
            lambda: conn.execute("SELECT count(*) FROM streamq_pending").fetchone() == (0,),
            what="the killed writer's session to end",
        )
        assert conn.execute("SELECT count(*) FROM streamq_log").fetchone() == (5,)


async def test_a_round_committed_before_its_connection_was_lost_is_served(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The numberer's connection dies right after a round's COMMIT, before it learns the
    round was flushed (a dead socket where the pipelined wait's answer should be): once
    connected again it finds the round committed and serves it, so whoever waits for
    those records learns their seqs instead of waiting for ever."""
    failed: list[bool] = []
    waited = Numberer._waited

    def lose_the_connection_once(self: Numberer, row: tuple[bool, int | None, int]) -> bool:
        if self._unflushed and not failed:
            failed.append(True)
            raise psycopg.OperationalError("the connection is lost")
        return waited(self, row)

    monkeypatch.setattr(Numberer, "_waited", lose_the_connection_once)
    async with Producer(pg_url) as producer:
        await producer.create_stream("orders")
        async with asyncio.timeout(20), producer.transaction() as tx:
            receipt = await tx.publish("orders", b"x")
        assert failed == [True]
        assert await producer.wait_served(receipt) == range(1, 2)
        assert await producer.publish("orders", b"y") == 2
        received = await consume(producer.address, "orders", 2)
    assert [r.value for r in received] == [b"x", b"y"]
