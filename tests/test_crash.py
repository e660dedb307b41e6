"""Exactly-once under kill -9: real processes, real sockets, real SQLite files.

A producer process (tests/crash/producer_proc.py) publishes orders together with
its business rows; consumer processes (tests/crash/consumer_proc.py) apply them
into their own database. The test SIGKILLs consumers at random moments and right
after a commit, and producers in the middle of a transaction and at random
moments, restarting each on the same files (and the producer on the same port).
At the end the consumer's database must hold every committed record exactly
once, and the producer's business rows must match its log one to one.

Set STREAMQ_CRASH_SEED to replay a run; the seed is in every failure message.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

import streamq
from streamq.store import HEAD_QUERY

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = Path(__file__).resolve().parent / "crash"
STREAM = "orders"

TOTAL = 12_000  # records published in all
CONSUMER_KILLS = 30  # at least, half at random moments, half right after a commit
PRODUCER_LIVES = ["mid-tx", "external"] * 3  # producer processes that get killed
KILL_PHASE_CAP = TOTAL - 1_000  # published while killing: the consumer never finishes early
CHUNK = 300  # records released to the producer per round
TICK = 150  # and when a consumer waiting for its K-th commit has applied all
PACE = 1_000  # records per second the producer publishes at, at most
MAX_ROUNDS = 80
STARTUP_TIMEOUT = 20.0
LAST_RUN_TIMEOUT = 40.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Proc:
    """A program of tests/crash, its output going to a log file."""

    def __init__(self, program: str, args: list[str], log: Path) -> None:
        self.log = log
        paths = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
        with log.open("wb") as out:
            self.popen = subprocess.Popen(
                [sys.executable, str(PROGRAMS / program), *args],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def lines(self) -> list[str]:
        return self.log.read_text(errors="replace").splitlines()

    def line(self, prefix: str) -> str | None:
        return next((line for line in self.lines() if line.startswith(prefix)), None)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_line(self, prefix: str, timeout: float, context: Callable[[], str]) -> str:
        """The first output line starting with ``prefix``, waiting for it up to ``timeout``."""
        deadline = time.monotonic() + timeout
        while (line := self.line(prefix)) is None:
            assert self.alive(), (
                f"{self.log.name} exited ({self.popen.returncode}) before {prefix!r}: {context()}"
            )
            assert time.monotonic() < deadline, (
                f"no {prefix!r} from {self.log.name} within {timeout} s: {context()}"
            )
            time.sleep(0.01)
        return line

    def kill(self) -> bool:
        """SIGKILL; True if the process was still running when the signal was sent."""
        if self.popen.poll() is not None:
            return False
        self.popen.kill()
        self.popen.wait(timeout=10)
        return self.popen.returncode == -signal.SIGKILL

    def wait(self, timeout: float) -> int | None:
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def tail(self, n: int = 15) -> str:
        return "\n".join(self.lines()[-n:])


def consumer_progress(consumer: Proc) -> int:
    """The last seq the consumer process says it has applied."""
    seq = 0
    for line in consumer.lines():
        if line.startswith(("SUBSCRIBED", "COMMIT")):
            seq = int(line.rpartition("=")[2])
    return seq


def consumer_state(path: Path) -> tuple[int, int, int, int]:
    """(position, rows, distinct seqs, max seq) of the consumer's database."""
    if not path.exists():
        return 0, 0, 0, 0
    with sqlite3.connect(path, timeout=10) as db:
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        position = 0
        if "streamq_positions" in tables:
            rows = db.execute(
                "SELECT seq FROM streamq_positions WHERE consumer = 'billing' AND stream = ?",
                (STREAM,),
            ).fetchall()
            assert len(rows) <= 1, rows
            position = rows[0][0] if rows else 0
        count = distinct = top = 0
        if "applied" in tables:
            count, distinct, top = db.execute(
                "SELECT COUNT(*), COUNT(DISTINCT seq), COALESCE(MAX(seq), 0) FROM applied"
            ).fetchone()
    db.close()
    return position, count, distinct, top


class CrashRun:
    def __init__(self, tmp_path: Path, seed: int) -> None:
        self.dir = tmp_path
        self.seed = seed
        self.rng = random.Random(seed)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.producer_db = tmp_path / "producer.db"
        self.consumer_db = tmp_path / "consumer.db"
        self.allow_file = tmp_path / "allow"
        self.allowed = 0
        self.producer: Proc | None = None
        self.producer_life = ""
        self.lives = list(PRODUCER_LIVES)
        self.rng.shuffle(self.lives)
        self.consumer: Proc | None = None
        self.starts = {"producer": 0, "consumer": 0}
        self.kills: Counter[str] = Counter()
        self.position = 0
        self.events: list[str] = []

    def context(self) -> str:
        return (
            f"seed={self.seed} (STREAMQ_CRASH_SEED), logs in {self.dir}, kills {dict(self.kills)}; "
            "last events:\n  " + "\n  ".join(self.events[-12:])
        )

    def event(self, text: str) -> None:
        self.events.append(f"{time.monotonic():.3f} {text}")

    def allow(self, records: int) -> None:
        self.allowed = min(records, TOTAL)
        tmp = self.allow_file.with_suffix(".tmp")
        tmp.write_text(str(self.allowed))
        tmp.replace(self.allow_file)

    # --- the producer --------------------------------------------------------

    def start_producer(self) -> None:
        self.producer_life = self.lives.pop() if self.lives else "final"
        args = [str(self.producer_db), str(self.port), str(TOTAL)]
        args += ["--allow", str(self.allow_file), "--pace", str(PACE)]
        args += ["--seed", str(self.rng.randrange(2**32))]
        if self.producer_life == "mid-tx":
            args += ["--kill-mid-tx-after", str(self.rng.randint(1, 10))]
        self.starts["producer"] += 1
        name = f"producer-{self.starts['producer']}.log"
        self.producer = Proc("producer_proc.py", args, self.dir / name)
        ready = self.producer.wait_line("READY", STARTUP_TIMEOUT, self.context)
        self.event(f"{name} ({self.producer_life}): {ready}")

    def tend_producer(self) -> None:
        """Restart the producer if it killed itself mid-transaction."""
        producer = self.producer
        assert producer is not None
        if producer.alive():
            return
        rc = producer.popen.returncode
        killed = producer.line("KILL-MID-TX")
        assert rc == -signal.SIGKILL and killed and self.producer_life == "mid-tx", (
            f"{producer.log.name} ({self.producer_life}) exited with {rc}:\n"
            f"{producer.tail()}\n{self.context()}"
        )
        self.kills["producer mid-tx"] += 1
        self.event(f"{producer.log.name}: {killed}")
        self.start_producer()
        # Nothing of the killed transaction was committed: the head is where it began.
        head_at_kill = killed.split("head=")[1].split()[0]
        assert self.producer is not None
        ready = self.producer.line("READY")
        assert ready is not None and ready.endswith(f"head={head_at_kill}"), (
            f"{ready} after {killed}: {self.context()}"
        )

    def kill_producer(self) -> None:
        assert self.producer is not None
        if self.producer.kill():
            self.kills["producer external"] += 1
            self.event(f"{self.producer.log.name}: killed")
            self.start_producer()
        else:
            self.tend_producer()

    # --- the consumer --------------------------------------------------------

    def start_consumer(self, kill_after_commit: int = 0) -> Proc:
        args = [self.address, str(self.consumer_db), str(TOTAL)]
        if kill_after_commit:
            args += ["--kill-after-commit", str(kill_after_commit)]
        self.starts["consumer"] += 1
        name = f"consumer-{self.starts['consumer']}.log"
        self.event(f"{name}: start, kill after commit {kill_after_commit or '-'}")
        self.consumer = Proc("consumer_proc.py", args, self.dir / name)
        return self.consumer

    def check_consumer_db(self) -> None:
        """Between runs: every applied record once, and the position says how far."""
        position, count, distinct, top = consumer_state(self.consumer_db)
        assert count == distinct == top == position, (
            f"consumer DB after a kill: position {position}, {count} rows, "
            f"{distinct} distinct seqs, max seq {top}: {self.context()}"
        )
        assert position >= self.position, f"position went back: {self.context()}"
        self.position = position

    def round(self, number: int) -> None:
        self.tend_producer()
        self.allow(min(self.allowed + CHUNK, KILL_PHASE_CAP))
        kill_after_commit = self.rng.randint(1, 4) if number % 2 else 0
        consumer = self.start_consumer(kill_after_commit)
        if self.producer_life == "external" and self.rng.random() < 0.3:
            time.sleep(self.rng.uniform(0.05, 0.5))  # fault injection, not synchronization
            self.kill_producer()
        if not kill_after_commit:
            time.sleep(self.rng.uniform(0.05, 0.5))  # fault injection
            if consumer.kill():
                self.kills["consumer at random"] += 1
        else:
            self.await_kill_after_commit(consumer)
        rc = consumer.popen.returncode
        assert rc == -signal.SIGKILL, (
            f"{consumer.log.name} exited with {rc}:\n{consumer.tail()}\n{self.context()}"
        )
        self.event(f"{consumer.log.name}: killed; {consumer.tail(1)}")
        self.check_consumer_db()

    def await_kill_after_commit(self, consumer: Proc) -> None:
        """Wait for the consumer to kill itself, releasing records when it has applied all."""
        deadline = time.monotonic() + 30
        idle_since = None
        while consumer.wait(timeout=0.5) is None:
            assert time.monotonic() < deadline, (
                f"{consumer.log.name} neither committed nor exited in 30 s:\n"
                f"{consumer.tail()}\n{self.context()}"
            )
            self.tend_producer()
            if consumer_progress(consumer) < self.allowed:
                continue
            if self.allowed < KILL_PHASE_CAP:
                self.allow(min(self.allowed + TICK, KILL_PHASE_CAP))
                continue
            # All the kill phase may publish is published: kill it while it waits.
            idle_since = idle_since or time.monotonic()
            if time.monotonic() - idle_since > 2 and consumer.kill():
                self.kills["consumer at random"] += 1
                return
        if consumer.popen.returncode == -signal.SIGKILL and consumer.line("KILL-AFTER-COMMIT"):
            self.kills["consumer after commit"] += 1

    def consumer_kills(self) -> int:
        return self.kills["consumer at random"] + self.kills["consumer after commit"]

    def producer_kills(self) -> int:
        return self.kills["producer mid-tx"] + self.kills["producer external"]

    def stop(self) -> None:
        for proc in (self.consumer, self.producer):
            if proc is not None:
                proc.kill()
                proc.wait(timeout=10)


def read_log(address: str, context: Callable[[], str]) -> dict[int, bytes]:
    """Every record of the stream, as the producer serves it."""
    records: dict[int, bytes] = {}
    with streamq.Client(address, timeout=20) as client:
        info = client.head(STREAM)
        assert info.head == TOTAL, f"{info}: {context()}"
        for batch in client.read_range(STREAM, 1, TOTAL + 1):
            for record in batch:
                assert record.seq not in records, f"seq {record.seq} served twice: {context()}"
                records[record.seq] = record.value
    return records


@pytest.mark.timeout(120)
def test_exactly_once_under_kill_9(tmp_path: Path) -> None:
    seed = int(os.environ.get("STREAMQ_CRASH_SEED") or random.randrange(2**32))
    run = CrashRun(tmp_path, seed)
    started = time.monotonic()
    try:
        run.allow(0)
        run.start_producer()
        number = 0
        while run.consumer_kills() < CONSUMER_KILLS or run.producer_life != "final":
            number += 1
            assert number <= MAX_ROUNDS, (
                f"kills still missing after {MAX_ROUNDS} rounds: {run.context()}"
            )
            run.round(number)

        # Let both run to completion.
        run.tend_producer()
        run.allow(TOTAL)
        consumer = run.start_consumer()
        rc = consumer.wait(timeout=LAST_RUN_TIMEOUT)
        assert rc == 0, f"last consumer: exit {rc}:\n{consumer.tail()}\n{run.context()}"
        assert consumer.line("DONE") == f"DONE applied={TOTAL}", run.context()
        assert run.producer is not None
        run.producer.wait_line("COMPLETE", STARTUP_TIMEOUT, run.context)
        records = read_log(run.address, run.context)
    finally:
        run.stop()
    context = run.context()

    # Enough faults were delivered.
    assert run.kills["consumer at random"] >= 8, context
    assert run.kills["consumer after commit"] >= 8, context
    assert run.consumer_kills() >= CONSUMER_KILLS, context
    assert run.producer_kills() == len(PRODUCER_LIVES) >= 5, context
    assert run.kills["producer mid-tx"] == PRODUCER_LIVES.count("mid-tx"), context
    assert run.kills["producer external"] == PRODUCER_LIVES.count("external"), context
    assert sorted(records) == list(range(1, TOTAL + 1)), context

    # The consumer applied every committed record exactly once, and knows it.
    with sqlite3.connect(run.consumer_db) as db:
        applied = db.execute("SELECT seq, value FROM applied").fetchall()
        positions = db.execute(
            "SELECT producer_id, stream, seq FROM streamq_positions WHERE consumer = 'billing'"
        ).fetchall()
    db.close()
    seqs = Counter(seq for seq, _ in applied)
    duplicated = sorted(seq for seq, n in seqs.items() if n > 1)
    missing = sorted(set(records) - set(seqs))
    unknown = sorted(set(seqs) - set(records))
    assert not duplicated, (
        f"{len(duplicated)} seqs applied twice, e.g. {duplicated[:20]}: {context}"
    )
    assert not missing, f"{len(missing)} seqs never applied, e.g. {missing[:20]}: {context}"
    assert not unknown, f"applied seqs the producer never committed: {unknown[:20]}: {context}"
    assert len(applied) == TOTAL, context
    wrong = [seq for seq, value in applied if value != records[seq]]
    assert not wrong, (
        f"{len(wrong)} records applied with another value, e.g. {wrong[:20]}: {context}"
    )
    assert len(positions) == 1, f"{positions}: {context}"
    assert positions[0][1:] == (STREAM, TOTAL), f"{positions}: {context}"

    # The producer never half-committed a transaction: its business rows and its
    # log match one to one, though it was killed in the middle of transactions.
    with sqlite3.connect(run.producer_db) as db:
        orders = dict(db.execute("SELECT id, amount FROM orders").fetchall())
        totals = db.execute("SELECT n, amount FROM totals WHERE name = 'orders'").fetchone()
        stored = db.execute("SELECT COUNT(*) FROM streamq_log").fetchone()[0]
        head = db.execute(HEAD_QUERY, (STREAM,)).fetchone()
        producer_id = db.execute(
            "SELECT value FROM streamq_meta WHERE key = 'producer_id'"
        ).fetchone()
    db.close()
    assert positions[0][0] == producer_id[0], context
    assert stored == TOTAL and head == (TOTAL,), f"{stored} records, head {head}: {context}"
    published: Counter[int] = Counter()
    for seq, value in records.items():
        name, _, amount = value.decode().partition(":")
        order_id = int(name.removeprefix("order-"))
        published[order_id] += 1
        assert orders.get(order_id) == int(amount), (
            f"seq {seq} = {value!r}, order {orders.get(order_id)}: {context}"
        )
    assert max(published.values()) == 1, (
        f"orders published twice: {published.most_common(5)}: {context}"
    )
    assert set(published) == set(orders), (
        f"{len(set(orders) - set(published))} orders never published, "
        f"{len(set(published) - set(orders))} published orders not in the table: {context}"
    )
    assert totals == (TOTAL, sum(orders.values())), f"totals {totals}: {context}"

    elapsed = time.monotonic() - started
    print(f"crash test: seed {seed}, {dict(run.kills)}, {TOTAL} records, {elapsed:.1f} s")
