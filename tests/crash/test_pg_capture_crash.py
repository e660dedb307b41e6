"""Capture exactly once through crashes: a serving producer (``streamq serve --capture``,
its own process) is killed with -9 at random moments and started again, and the
PostgreSQL server itself is killed with -9 (crash recovery, a replication slot taken back
to its last checkpoint), while a writer commits rows. At the end, the table's stream holds
each committed row exactly once, in commit order: nothing captured twice, nothing
skipped, and no row whose commit failed."""

from __future__ import annotations

import contextlib
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

import streamq
from streamq.captured import decode_change

from ..conftest import started_server
from ..pgserver import PostgresServer
from ..waiting import wait_until

PRODUCER_KILLS = 8
SERVER_KILLS = 2  # after producer kills 3 and 6
SEED = random.randrange(2**32)


@pytest.fixture(scope="module")
def server() -> Iterator[PostgresServer]:
    """A server of this module's own: it is killed."""
    yield from started_server({"wal_level": "logical"})


class Writer(threading.Thread):
    """Commits one to three rows a transaction, ids ascending, as fast as it can; through
    server kills, by connecting again. ``committed``: ids whose COMMIT returned;
    ``unsure``: those whose COMMIT failed (committed or not: the table says)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.committed: list[int] = []
        self.unsure: list[int] = []
        self.stop = threading.Event()
        self.failures = 0

    def run(self) -> None:
        rng = random.Random(SEED)
        next_id = 1
        conn: psycopg.Connection | None = None
        while not self.stop.is_set():
            ids = list(range(next_id, next_id + rng.randint(1, 3)))
            try:
                if conn is None or conn.closed or conn.broken:
                    conn = psycopg.connect(self.url, connect_timeout=2)
                with conn.transaction():
                    for i in ids:
                        conn.execute("INSERT INTO orders VALUES (%s, %s)", (i, i * 10))
            except psycopg.Error:
                self.failures += 1
                self.unsure += ids
                next_id = ids[-1] + 1
                time.sleep(0.05)  # the server is restarting: a pause between tries
                continue
            self.committed += ids
            next_id = ids[-1] + 1
            time.sleep(0.002)
        if conn is not None:
            conn.close()


class Serving:
    """``streamq serve URL --capture orders`` (and ``options``) in a process of its own,
    started again after each kill (and while the serving lock of a killed one is still held)."""

    def __init__(self, url: str, log: Path, *options: str) -> None:
        self.url, self.log, self.options = url, log, options
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ""
        self.lives = 0

    def start(self) -> None:
        def started() -> bool:
            with self.log.open("ab") as out:
                self.proc = subprocess.Popen(
                    [
                        *STREAMQ,
                        "serve",
                        self.url,
                        "--init",  # the log tables, in a database that may not have them yet
                        "--port",
                        "0",
                        "--capture",
                        "orders",
                        *self.options,
                    ],
                    stdout=subprocess.PIPE,
                    stderr=out,
                )
            assert self.proc.stdout is not None
            line = self.proc.stdout.readline().decode()
            if line.startswith("serving producer"):
                self.address = line.rsplit(" on ", 1)[1].strip()
                self.lives += 1
                return True
            self._reap()  # refused (the lock still held, the server down)
            return False

        wait_until(started, f"a serving producer (log: {self.log})", timeout=60)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self._reap()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self._reap()

    def _reap(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        self.proc.wait(timeout=30)
        self.proc.stdout.close()


STREAMQ = [sys.executable, "-m", "streamq"]


def head(address: str) -> int:
    with streamq.Client(address) as client:
        (info,) = [s for s in client.streams() if s.stream == "public.orders"]
    return info.head


def read_stream(address: str) -> list[streamq.Record]:
    """Every record of the stream, up to its head now."""
    with streamq.Client(address) as client:
        end = head(address) + 1
        return [record for batch in client.read_range("public.orders", 1, end) for record in batch]


@contextlib.contextmanager
def capturing(
    server: PostgresServer, name: str, tmp_path: Path, *options: str
) -> Iterator[tuple[str, Serving, Writer]]:
    """A database ``name`` with the table ``orders``, a serving producer capturing it
    (with ``options``) and a writer, neither started; both stopped and the database
    dropped at the end."""
    url = server.create_database(name)
    with psycopg.connect(url) as conn:
        conn.execute("CREATE TABLE orders (id integer PRIMARY KEY, v integer)")
    serving, writer = Serving(url, tmp_path / "serve.log", *options), Writer(url)
    try:
        yield url, serving, writer
    finally:
        writer.stop.set()
        serving.stop()
        with contextlib.suppress(Exception):
            server.drop_database(name, slots=True)


def stop_and_read(
    writer: Writer, serving: Serving, url: str
) -> tuple[list[int], list[streamq.Record]]:
    """Once the writer has stopped: the table's ids, in id order, and, once as many are
    captured, every record of the stream."""
    writer.stop.set()
    writer.join(timeout=30)
    with psycopg.connect(url) as conn:
        rows = [i for (i,) in conn.execute("SELECT id FROM orders ORDER BY id").fetchall()]
    wait_until(lambda: head(serving.address) >= len(rows), "every row captured", 60)
    return rows, read_stream(serving.address)


def test_capture_is_exactly_once_through_kills_of_the_producer_and_the_server(
    server: PostgresServer, tmp_path: Path, figures: Callable[[str], None]
) -> None:
    rng = random.Random(SEED)
    with capturing(server, "crash", tmp_path) as (url, serving, writer):
        subprocess.run([*STREAMQ, "init", url, "--capture", "orders"], check=True, timeout=60)
        serving.start()
        writer.start()
        for kill in range(1, PRODUCER_KILLS + 1):
            time.sleep(rng.uniform(0.05, 0.5))  # a random moment of the capture's work
            serving.kill()
            if kill % 3 == 0 and kill // 3 <= SERVER_KILLS:
                server.kill()
                server.restart()
            serving.start()
        wait_until(lambda: len(writer.committed) > 0, "the writer to commit")
        rows, records = stop_and_read(writer, serving, url)
        assert set(writer.committed) <= set(rows) <= set(writer.committed) | set(writer.unsure)
    changes = [decode_change(r.value) for r in records]
    ids = [c["new"]["id"] for c in changes]
    context = f"seed {SEED}, {serving.lives} producer lives, {writer.failures} failed commits"
    assert len(ids) == len(set(ids)), f"captured twice ({context})"
    assert ids == rows, f"captured rows differ from the table's ({context})"
    assert [r.seq for r in records] == list(range(1, len(rows) + 1))
    assert all(c["op"] == "insert" and c["new"]["v"] == c["new"]["id"] * 10 for c in changes)
    figures(
        f"{len(rows)} rows captured once each through {PRODUCER_KILLS} producer kills and "
        f"{SERVER_KILLS} server kills ({context}); 0 anomalies"
    )


SNAPSHOT_ROWS = 60_000


def test_a_snapshot_cut_by_a_kill_is_taken_again_whole(
    server: PostgresServer, tmp_path: Path
) -> None:
    """The serving producer is killed while its snapshot is being published, a writer
    committing throughout: started again, it takes a new snapshot, and the stream holds
    each row once, the snapshot's then the later inserts."""
    with capturing(server, "snapshot", tmp_path, "--snapshot") as (url, serving, writer):
        with psycopg.connect(url) as conn:
            conn.execute(
                "INSERT INTO orders SELECT -i, -i * 10 FROM generate_series(1, %s) AS i",
                (SNAPSHOT_ROWS,),
            )
        writer.start()
        serving.start()
        wait_until(lambda: _publishing_snapshot(url), "the snapshot's first rows", 60)
        serving.kill()
        with psycopg.connect(url) as conn:
            taken = conn.execute("SELECT count(*) FROM streamq_capture_snapshot").fetchone()
        assert taken == (0,), "the kill came after the snapshot: the test did not cut it"
        serving.start()
        wait_until(lambda: head(serving.address) > SNAPSHOT_ROWS, "the snapshot", 120)
        rows, records = stop_and_read(writer, serving, url)
    changes = [decode_change(r.value) for r in records]
    ids = [c["new"]["id"] for c in changes]
    assert len(ids) == len(set(ids)) and sorted(ids) == sorted(rows)
    ops = [c["op"] for c in changes]
    snapshot = ops.count("snapshot")
    assert ops == ["snapshot"] * snapshot + ["insert"] * (len(ops) - snapshot)
    assert {c["lsn"] for c in changes[:snapshot]} == {changes[0]["lsn"]}
    assert snapshot >= SNAPSHOT_ROWS and all(c["new"]["v"] == c["new"]["id"] * 10 for c in changes)


def _publishing_snapshot(url: str) -> bool:
    """Whether the producer's snapshot has begun publishing rows (its transaction has an
    id: it has written)."""
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE application_name = 'streamq snapshot' AND backend_xid IS NOT NULL"
        ).fetchone()
    return row == (1,)
