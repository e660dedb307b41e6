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
from streamq.capturing import decode_change

from .conftest import started_server
from .pgserver import PostgresServer
from .waiting import wait_until

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
    """``streamq serve URL --capture orders`` in a process of its own, started again
    after each kill (and while the serving lock of a killed one is still held)."""

    def __init__(self, url: str, log: Path) -> None:
        self.url, self.log = url, log
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ""
        self.lives = 0

    def start(self) -> None:
        def started() -> bool:
            with self.log.open("ab") as out:
                self.proc = subprocess.Popen(
                    [*STREAMQ, "serve", self.url, "--port", "0", "--capture", "orders"],
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


def test_capture_is_exactly_once_through_kills_of_the_producer_and_the_server(
    server: PostgresServer, tmp_path: Path, figures: Callable[[str], None]
) -> None:
    url = server.create_database("crash")
    with psycopg.connect(url) as conn:
        conn.execute("CREATE TABLE orders (id integer PRIMARY KEY, v integer)")
    subprocess.run([*STREAMQ, "init", url, "--capture", "orders"], check=True, timeout=60)
    serving = Serving(url, tmp_path / "serve.log")
    writer = Writer(url)
    rng = random.Random(SEED)
    try:
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
        writer.stop.set()
        writer.join(timeout=30)
        with psycopg.connect(url) as conn:
            rows = [i for (i,) in conn.execute("SELECT id FROM orders ORDER BY id").fetchall()]
        assert set(writer.committed) <= set(rows) <= set(writer.committed) | set(writer.unsure)
        wait_until(lambda: head(serving.address) >= len(rows), "every row captured", 60)
        records = read_stream(serving.address)
    finally:
        writer.stop.set()
        serving.stop()
        with contextlib.suppress(Exception):
            server.drop_database("crash", slots=True)
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
