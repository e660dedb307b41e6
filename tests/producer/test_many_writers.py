"""Many processes publish into one producer database at once; one process serves it.

Real worker processes, each through a different kind of connection, commit at the same
time as the serving producer's own transactions: no transaction is refused, the log is
dense and in commit order, and a consumer receives every committed order exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import sqlite3
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import streamq
from streamq import Consumer, Producer
from streamq.producer.commit_watcher import BUSY_GAP, MAX_BUSY_GAP, least_gap

from ..conftest import wait_for
from ..writers.worker import ORDERS

ROOT = Path(__file__).resolve().parents[2]
VIAS = ("publish", "legacy", "sqlalchemy", "sync")


class Worker:
    """A worker process (tests/writers/worker.py), ready to start when told."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @classmethod
    async def ready(
        cls, db: str, name: str, via: str, transactions: int, pause: float = 0.001
    ) -> Worker:
        process = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "tests.writers.worker", db, name, "--via", via),
            *("--transactions", str(transactions), "--pause", str(pause)),
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        assert process.stdout is not None
        async with asyncio.timeout(60):
            line = await process.stdout.readline()
        assert line == b"READY\n", line + await process.stdout.read()
        return cls(process)

    async def run(self) -> str:
        """Start it; its output once it is done."""
        try:
            async with asyncio.timeout(120):
                output, _ = await self.process.communicate(b"go\n")
        finally:
            if self.process.returncode is None:
                self.process.kill()
                await self.process.wait()
        assert self.process.returncode == 0, output.decode()
        return output.decode()


async def test_worker_processes_and_the_server_commit_at_once(producer_db: str) -> None:
    per_writer = 300
    async with Producer(producer_db) as producer:
        async with producer.transaction() as tx:
            await tx.execute(ORDERS)
        workers = [
            await Worker.ready(producer_db, f"w{i}", via, per_writer) for i, via in enumerate(VIAS)
        ]

        async def serve_and_write() -> None:
            for n in range(per_writer):  # the serving process writes too, interleaved
                async with producer.transaction() as tx:
                    await tx.execute("INSERT INTO orders (worker, n) VALUES ('server', ?)", (n,))
                    await tx.publish("orders", b"server:%d" % n, key=b"server")
                await asyncio.sleep(0.001)  # as requests come, not a tight loop

        *outputs, _ = await asyncio.gather(*(w.run() for w in workers), serve_and_write())
        total = per_writer * (len(VIAS) + 1)
        records: list[streamq.Record] = []
        async with Consumer(producer.address, "orders") as consumer:
            async with asyncio.timeout(30):
                async for batch in consumer:
                    records += batch
                    if batch.last_seq >= total:
                        break
    for output in outputs:
        assert f"DONE committed={per_writer} refused=0" in output, output
    assert [r.seq for r in records] == list(range(1, total + 1))  # dense, none twice
    with sqlite3.connect(producer_db) as db:
        orders = {f"{w}:{n}".encode() for w, n in db.execute("SELECT worker, n FROM orders")}
    assert len(orders) == total
    assert Counter(r.value for r in records) == Counter(orders)  # each committed order once
    runs = sum(1 for a, b in itertools.pairwise(records) if a.key != b.key)
    assert runs > 10, "the writers did not overlap: nothing was tested"
    for name in [f"w{i}" for i in range(len(VIAS))] + ["server"]:  # each writer's own order
        mine = [int(r.value.split(b":")[1]) for r in records if r.key == name.encode()]
        assert mine == list(range(per_writer))


async def test_a_second_serving_process_is_refused_naming_the_first(producer_db: str) -> None:
    async with Producer(producer_db) as first:
        program = (
            "import asyncio, streamq, sys\n"
            "async def main():\n"
            "    async with streamq.Producer(sys.argv[1]): pass\n"
            "asyncio.run(main())\n"
        )
        refused = subprocess.run(
            [sys.executable, "-c", program, producer_db],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert refused.returncode != 0
        assert "AlreadyServedError" in refused.stderr
        assert f"process {os.getpid()}" in refused.stderr and first.address in refused.stderr
        assert producer_db in refused.stderr
        with pytest.raises(streamq.AlreadyServedError, match="already served"):
            async with Producer(producer_db):  # in this process too
                pass
        async with Producer(producer_db, serve=False) as writer:  # writers are welcome
            assert await writer.publish("orders", b"x") == 1
        await first.publish("orders", b"still serving")
    async with Producer(producer_db) as second:  # the lock went with the first
        assert second.head("orders") == 2


@pytest.mark.parametrize("kind", ["directory", "not a database", "missing directory"])
def test_a_path_that_cannot_be_a_database_is_named_and_leaks_nothing(
    tmp_path: Path, kind: str
) -> None:
    """A precise error naming the file, and no aiosqlite thread left behind to report to
    a closed event loop ("Event loop is closed" printed after the program ended)."""
    path = tmp_path / "orders.db"
    if kind == "directory":
        path.mkdir()
    elif kind == "not a database":
        path.write_bytes(b"these are not the pages of a SQLite database " * 100)
    else:
        path = tmp_path / "nowhere" / "orders.db"
    program = (
        "import asyncio, streamq, sys\n"
        "async def main():\n"
        "    async with streamq.Producer(sys.argv[1], serve=False): pass\n"
        "try:\n"
        "    asyncio.run(main())\n"
        "except streamq.DatabaseOpenError as exc:\n"
        "    print('ERROR', exc)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", program, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.stdout.startswith(f"ERROR cannot open SQLite database {str(path)!r}: ")
    reason = {"directory": "it is a directory", "missing directory": "no such directory"}
    assert reason.get(kind, "file is not a database") in result.stdout
    assert result.stderr == ""  # nothing printed after the loop closed


async def test_a_consumer_database_that_cannot_be_opened_is_named(
    producer_db: str, tmp_path: Path
) -> None:
    async with Producer(producer_db) as producer:
        await producer.publish("orders", b"x")
        consumer = Consumer(producer.address, "orders", db=str(tmp_path), name="c")
        with pytest.raises(streamq.DatabaseOpenError, match="it is a directory"):
            await consumer.start()
        await producer.publish("orders", b"the producer goes on")


async def test_connections_switching_a_new_database_to_wal_at_once_all_open(
    tmp_path: Path,
) -> None:
    """Worker processes starting together, or consumers sharing a database, switch a new
    database to WAL at the same moment: SQLite refuses some of them at once, without
    waiting its busy timeout, and each must open all the same."""
    from streamq.engines.sqlite.positions import open_database
    from streamq.engines.sqlite.storage import open_writer

    for n in range(20):
        for opener in (open_writer, open_database):
            path = str(tmp_path / f"{opener.__name__}-{n}.db")
            connections = await asyncio.gather(*(opener(path, "normal") for _ in range(4)))
            for conn in connections:
                mode = await conn.execute_fetchall("PRAGMA journal_mode")
                await conn.close()
                assert list(mode) == [("wal",)]


async def test_commits_of_others_are_served_while_the_producer_waits_for_the_write_lock(
    producer_db: str,
) -> None:
    """While the serving producer's own transaction waits at BEGIN for another
    connection's write lock, that connection's commits are answered and pushed (read on a
    read connection): a client that saw its commit return finds it served. The other
    connection takes the lock again at once, so the producer keeps waiting throughout."""

    def read(address: str) -> tuple[int, list[bytes]]:
        with streamq.Client(address) as client:
            head = client.head("orders").head
            return head, [r.value for batch in client.read_range("orders", 1, 2) for r in batch]

    async with Producer(producer_db) as producer:
        await producer.create_stream("orders")
        other = sqlite3.connect(producer_db, isolation_level=None, timeout=10)
        async with Consumer(producer.address, "orders") as subscriber:
            other.execute("BEGIN IMMEDIATE")

            async def mine() -> int:
                async with producer.transaction() as tx:  # waits at BEGIN for `other`
                    return await tx.publish("orders", b"mine")

            task = asyncio.create_task(mine())
            await wait_for(
                lambda: producer.beginning is not None, what="the producer waiting at BEGIN"
            )
            assert streamq.publish(other, "orders", b"theirs") == 1
            # Committed (executescript commits first) and taken again in one call, with no
            # Python between the two: a producer's retry of its BEGIN in that gap (a
            # descheduled test thread, on a loaded machine) took the lock once.
            other.executescript("BEGIN IMMEDIATE")  # the producer waits on
            assert await asyncio.to_thread(read, producer.address) == (1, [b"theirs"])
            async with asyncio.timeout(10):
                pushed = await anext(subscriber)
            assert [(r.seq, r.value) for r in pushed] == [(1, b"theirs")]
            assert not task.done() and producer.beginning is not None, "the producer took the lock"
            other.execute("ROLLBACK")
            other.close()
            assert await task == 2
            async with asyncio.timeout(10):
                pushed = await anext(subscriber)
            assert [(r.seq, r.value) for r in pushed] == [(2, b"mine")]


async def test_with_nobody_waiting_commits_are_not_caught_up_one_by_one(producer_db: str) -> None:
    """Another connection commits 300 times back to back while nobody waits for a commit:
    the serving producer looks far less often than once per commit (at most once per
    ``commit_watcher.IDLE_CHECK``), yet every commit is there for the consumer that comes next,
    and a consumer waiting at the head gets each commit pushed."""
    commits = 300

    def commit(count: int, start: int) -> None:
        with contextlib.closing(sqlite3.connect(producer_db, isolation_level=None)) as conn:
            for n in range(start, start + count):
                conn.execute("BEGIN IMMEDIATE")
                streamq.publish(conn, "orders", b"%d" % n)
                conn.execute("COMMIT")

    async with Producer(producer_db) as producer:
        await producer.create_stream("orders")
        looked, caught = producer.writing.looks, producer.writing.caught
        await asyncio.to_thread(commit, commits, 0)
        checks = producer.writing.looks - looked
        assert checks < commits / 4, f"{checks} looks for {commits} commits"
        async with Consumer(producer.address, "orders") as consumer:
            received: list[bytes] = []
            async with asyncio.timeout(20):
                while len(received) < commits:
                    received += [r.value for r in await anext(consumer)]
            assert received == [b"%d" % n for n in range(commits)]
            # Waiting at the head now: the next commits are looked for at once.
            await wait_for(
                lambda: producer.writing.log.waits.count > 0, what="the consumer waiting"
            )
            before = producer.writing.looks
            await asyncio.to_thread(commit, 1, commits)
            async with asyncio.timeout(20):
                assert [r.value for r in await anext(consumer)] == [b"%d" % commits]
            assert producer.writing.looks > before
        # Every record another connection committed was counted once, as caught up.
        assert producer.writing.caught - caught == commits + 1


@pytest.mark.parametrize(
    ("found", "least"),
    [(0, BUSY_GAP), (1, BUSY_GAP), (4, 2 * BUSY_GAP), (16, 4 * BUSY_GAP), (10**6, MAX_BUSY_GAP)],
)
def test_a_look_that_found_more_commits_waits_longer_before_the_next(
    found: int, least: float
) -> None:
    """The commit watcher's least gap after a look: the floor while commits come one at a
    time, growing as the square root of what a look found while they queue, capped."""
    assert least_gap(found) == pytest.approx(least)


async def test_while_the_fanout_serves_other_writers_commits_it_is_looked_for_once_a_round(
    producer_db: str,
) -> None:
    """A worker process commits back to back while a consumer follows at the head: the
    serving producer looks for those commits about once per fan-out round, when the
    fan-out has sent everything it knew of, not once per gap of its own. A look made during
    a round, or in the pause after one, only moves the head again before anyone reads it,
    and costs the serving process CPU beside the writer (issue #62, item 3)."""
    commits = 3000
    async with Producer(producer_db) as producer:
        async with producer.transaction() as tx:
            await tx.execute(ORDERS)
        await producer.create_stream("orders")
        server = producer.server
        assert server is not None
        stream = producer.log.streams["orders"]
        worker = await Worker.ready(producer_db, "w", "publish", commits, pause=0)
        async with Consumer(producer.address, "orders") as consumer:
            await wait_for(
                lambda: stream in server.fanouts and producer.writing.log.waits.count == 1,
                what="the consumer waiting at the head",
            )
            fanout = server.fanouts[stream]
            looks, rounds = producer.writing.looks, fanout.rounds
            received: list[bytes] = []

            async def receive() -> None:
                while len(received) < commits:
                    received.extend(r.value for r in await anext(consumer))

            receiving = asyncio.create_task(receive())
            try:
                assert "committed=3000 refused=0" in await worker.run()
                async with asyncio.timeout(60):
                    await receiving
            finally:
                receiving.cancel()
            looks, rounds = producer.writing.looks - looks, fanout.rounds - rounds
    assert received == [b"w:%d" % n for n in range(commits)]
    # A round follows each look that found commits; a look that found none looks again a
    # few times (``commit_watcher.RECHECK``).
    assert looks <= 1.5 * rounds + 20, f"{looks} looks for {rounds} rounds"
