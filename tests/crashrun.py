"""Exactly-once under kill -9 and SIGSTOP: the harness behind test_crash.py and ``make soak``.

A producer process (tests/crash/producer_proc.py) publishes orders together with its
business rows; consumer processes (tests/crash/consumer_proc.py) apply them into their
own database with the oracle's non-idempotent effect. A run SIGKILLs consumers at random
moments and at named fault points (before the transaction, after applying but before
COMMIT, right after COMMIT), and producers at random moments, in the middle of a
transaction and in the middle of pushing a frame; it also freezes either side with
SIGSTOP for longer than every timeout (the consumer's heartbeat and connect timeouts, the
producer's handshake and idle timeouts) before SIGCONT. Each killed process is restarted
on the same files (the producer on the same port). After every kill the oracle
(tests/oracle.py) checks the history so far, and at the end the whole of it: every
committed record applied exactly once, in order, nothing phantom, the stored position and
sum agreeing with the effects; and the producer's business rows match its log one to one.

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
from dataclasses import dataclass, field
from pathlib import Path

import streamq
from streamq.engines.sqlite.storage import HEAD_QUERY

from .oracle import History, Report, check, history_from_files

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = Path(__file__).resolve().parent / "crash"
STREAM = "orders"
CONSUMER = "billing"
CHUNK = 300  # records released to the producer per round
TICK = 150  # and when a consumer waiting for its fault point has applied all
PACE = 1_000  # records per second the producer publishes at, at most
STARTUP_TIMEOUT = 20.0
LAST_RUN_TIMEOUT = 40.0
# Timeouts the pauses outlast: the consumer's (the producer's are in producer_proc.py).
HEARTBEAT_TIMEOUT = 1.0
CONNECT_TIMEOUT = 1.0
PAUSE_SECONDS = (1.3, 1.8)  # SIGSTOP for this long: beyond every timeout of both sides

CONSUMER_FAULTS = ("random", "before-tx", "after-apply", "after-commit")


@dataclass(frozen=True)
class Plan:
    """How many faults of each kind one run delivers."""

    total: int = 12_000  # records published in all
    consumer_kills: int = 32  # at least, spread over CONSUMER_FAULTS
    producer_lives: tuple[str, ...] = ("mid-tx", "mid-push", "external") * 2
    pauses: tuple[str, ...] = ("producer", "consumer")
    max_rounds: int = 90

    @property
    def kill_phase_cap(self) -> int:
        """Records published while killing: the consumer never finishes early."""
        return self.total - 1_000


@dataclass
class Figures:
    """What a run did: faults by kind, records checked, anomalies found."""

    seed: int
    faults: Counter[str] = field(default_factory=Counter)
    records: int = 0
    checks: int = 0
    report: Report | None = None
    seconds: float = 0.0

    @property
    def kills(self) -> int:
        return sum(n for kind, n in self.faults.items() if "pause" not in kind)

    @property
    def anomalies(self) -> int:
        return self.report.anomalies if self.report else 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Proc:
    """A program of tests/crash, its output going to a log file."""

    def __init__(self, program: str, args: list[str], log: Path, fault: str = "") -> None:
        self.log = log
        paths = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), STREAMQ_FAULT=fault)
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

    def pause(self, seconds: float) -> bool:
        """SIGSTOP for ``seconds``, then SIGCONT; False if it had already exited."""
        if self.popen.poll() is not None:
            return False
        self.popen.send_signal(signal.SIGSTOP)
        time.sleep(seconds)  # the fault itself: frozen this long, not a synchronisation
        self.popen.send_signal(signal.SIGCONT)
        return True

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


class CrashRun:
    def __init__(self, directory: Path, seed: int, plan: Plan) -> None:
        self.dir = directory
        self.plan = plan
        self.figures = Figures(seed)
        self.rng = random.Random(seed)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.producer_db = directory / "producer.db"
        self.consumer_db = directory / "consumer.db"
        self.allow_file = directory / "allow"
        self.allowed = 0
        self.producer: Proc | None = None
        self.producer_life = ""
        self.lives = list(plan.producer_lives)
        self.rng.shuffle(self.lives)
        self.pauses = list(plan.pauses)
        self.consumer_faults = [
            CONSUMER_FAULTS[i % len(CONSUMER_FAULTS)] for i in range(plan.consumer_kills)
        ]
        self.rng.shuffle(self.consumer_faults)
        self.consumer: Proc | None = None
        self.starts = {"producer": 0, "consumer": 0}
        self.position = 0
        self.events: list[str] = []

    @property
    def faults(self) -> Counter[str]:
        return self.figures.faults

    def context(self) -> str:
        return (
            f"seed={self.figures.seed} (STREAMQ_CRASH_SEED), logs in {self.dir}, "
            f"faults {dict(self.faults)}; last events:\n  " + "\n  ".join(self.events[-12:])
        )

    def event(self, text: str) -> None:
        self.events.append(f"{time.monotonic():.3f} {text}")

    def allow(self, records: int) -> None:
        self.allowed = min(records, self.plan.total)
        tmp = self.allow_file.with_suffix(".tmp")
        tmp.write_text(str(self.allowed))
        tmp.replace(self.allow_file)

    def history(self, complete: bool) -> History:
        return history_from_files(
            self.producer_db,
            self.consumer_db,
            sorted(self.dir.glob("*.jsonl")),
            stream=STREAM,
            consumer=CONSUMER,
            complete=complete,
        )

    def check_history(self, complete: bool = False) -> Report:
        """The oracle on everything so far; any anomaly fails the run at once."""
        report = check(self.history(complete))
        self.figures.checks += 1
        assert report.ok, f"{report}: {self.context()}"
        return report

    # --- the producer --------------------------------------------------------

    def start_producer(self) -> None:
        self.producer_life = self.lives.pop() if self.lives else "final"
        args = [str(self.producer_db), str(self.port), str(self.plan.total)]
        args += ["--allow", str(self.allow_file), "--pace", str(PACE)]
        args += ["--seed", str(self.rng.randrange(2**32))]
        self.starts["producer"] += 1
        number = self.starts["producer"]
        args += ["--journal", str(self.dir / f"producer-{number}.jsonl")]
        fault = ""
        if self.producer_life == "mid-tx":
            fault = f"mid-tx:{self.rng.randint(1, 10)}"
        elif self.producer_life == "mid-push":
            fault = f"mid-push:{self.rng.randint(1, 4)}"
        name = f"producer-{number}.log"
        self.producer = Proc("producer_proc.py", args, self.dir / name, fault)
        ready = self.producer.wait_line("READY", STARTUP_TIMEOUT, self.context)
        self.event(f"{name} ({self.producer_life} {fault}): {ready}")

    def tend_producer(self) -> None:
        """Restart the producer if it killed itself at its fault point."""
        producer = self.producer
        assert producer is not None
        if producer.alive():
            return
        rc = producer.popen.returncode
        fired = producer.line("FAULT")
        life = self.producer_life
        assert rc == -signal.SIGKILL and fired and fired.split()[1] == life, (
            f"{producer.log.name} ({life}) exited with {rc}:\n{producer.tail()}\n{self.context()}"
        )
        self.faults[f"producer {life}"] += 1
        self.event(f"{producer.log.name}: {fired}")
        self.start_producer()
        if life == "mid-tx":
            # Nothing of the killed transaction was committed: the head is where it began.
            head_at_kill = fired.split("head=")[1].split()[0]
            assert self.producer is not None
            ready = self.producer.line("READY")
            assert ready is not None and ready.endswith(f"head={head_at_kill}"), (
                f"{ready} after {fired}: {self.context()}"
            )

    def kill_producer(self) -> None:
        assert self.producer is not None
        if self.producer.kill():
            self.faults["producer random"] += 1
            self.event(f"{self.producer.log.name}: killed")
            self.start_producer()
        else:
            self.tend_producer()

    # --- the consumer --------------------------------------------------------

    def start_consumer(self, fault: str = "") -> Proc:
        args = [self.address, str(self.consumer_db), str(self.plan.total)]
        args += ["--heartbeat-timeout", str(HEARTBEAT_TIMEOUT)]
        args += ["--connect-timeout", str(CONNECT_TIMEOUT)]
        self.starts["consumer"] += 1
        number = self.starts["consumer"]
        args += ["--journal", str(self.dir / f"consumer-{number}.jsonl")]
        name = f"consumer-{number}.log"
        self.event(f"{name}: start, fault {fault or '-'}")
        self.consumer = Proc("consumer_proc.py", args, self.dir / name, fault)
        return self.consumer

    def pause_one(self) -> None:
        """Freeze the producer or the consumer for longer than every timeout."""
        who = self.pauses.pop()
        proc = self.producer if who == "producer" else self.consumer
        assert proc is not None
        if proc.pause(self.rng.uniform(*PAUSE_SECONDS)):
            self.faults[f"{who} pause"] += 1
            self.event(f"{proc.log.name}: paused")
        else:
            self.pauses.append(who)

    def round(self) -> None:
        self.tend_producer()
        plan = self.plan
        self.allow(min(self.allowed + CHUNK, plan.kill_phase_cap))
        kind = self.consumer_faults.pop() if self.consumer_faults else "random"
        fault = "" if kind == "random" else f"{kind}:{self.rng.randint(1, 4)}"
        consumer = self.start_consumer(fault)
        if self.pauses and self.rng.random() < 0.3:
            time.sleep(self.rng.uniform(0.05, 0.5))  # fault injection, not synchronization
            self.pause_one()
        stuck = self.producer_life != "external" and self.allowed >= plan.kill_phase_cap
        if (self.producer_life == "external" and self.rng.random() < 0.3) or stuck:
            time.sleep(self.rng.uniform(0.05, 0.5))  # fault injection
            self.kill_producer()
        if kind == "random":
            time.sleep(self.rng.uniform(0.05, 0.5))  # fault injection
            if consumer.kill():
                self.faults["consumer random"] += 1
        else:
            self.await_fault(consumer, kind)
        rc = consumer.popen.returncode
        assert rc == -signal.SIGKILL, (
            f"{consumer.log.name} exited with {rc}:\n{consumer.tail()}\n{self.context()}"
        )
        self.event(f"{consumer.log.name}: killed; {consumer.tail(1)}")
        self.check_history()

    def await_fault(self, consumer: Proc, point: str) -> None:
        """Wait for the consumer to die at ``point``, releasing records when it has applied all."""
        deadline = time.monotonic() + 30
        idle_since = None
        cap = self.plan.kill_phase_cap
        while consumer.wait(timeout=0.2) is None:
            assert time.monotonic() < deadline, (
                f"{consumer.log.name} neither reached {point} nor exited in 30 s:\n"
                f"{consumer.tail()}\n{self.context()}"
            )
            self.tend_producer()
            if consumer_progress(consumer) < self.allowed:
                continue
            if self.allowed < cap:
                self.allow(min(self.allowed + TICK, cap))
                continue
            # All the kill phase may publish is published: kill it while it waits.
            idle_since = idle_since or time.monotonic()
            if time.monotonic() - idle_since > 2 and consumer.kill():
                self.faults["consumer random"] += 1
                return
        fired = consumer.line("FAULT")
        if consumer.popen.returncode == -signal.SIGKILL and fired:
            assert fired.split()[1] == point, f"{fired}: {self.context()}"
            self.faults[f"consumer {point}"] += 1

    def consumer_kills(self) -> int:
        return sum(
            n
            for kind, n in self.faults.items()
            if kind.startswith("consumer ") and "pause" not in kind
        )

    def stop(self) -> None:
        for proc in (self.consumer, self.producer):
            if proc is not None:
                proc.kill()
                proc.wait(timeout=10)

    # --- the whole run -------------------------------------------------------

    def run(self) -> Figures:
        started = time.monotonic()
        plan = self.plan
        try:
            self.allow(0)
            self.start_producer()
            rounds = 0
            while (
                self.consumer_kills() < plan.consumer_kills
                or self.producer_life != "final"
                or self.pauses
            ):
                rounds += 1
                assert rounds <= plan.max_rounds, (
                    f"faults still missing after {plan.max_rounds} rounds: {self.context()}"
                )
                self.round()

            # Let both run to completion.
            self.tend_producer()
            self.allow(plan.total)
            consumer = self.start_consumer()
            rc = consumer.wait(timeout=LAST_RUN_TIMEOUT)
            assert rc == 0, f"last consumer: exit {rc}:\n{consumer.tail()}\n{self.context()}"
            assert consumer.line("DONE") == f"DONE applied={plan.total}", self.context()
            assert self.producer is not None
            self.producer.wait_line("COMPLETE", STARTUP_TIMEOUT, self.context)
            served = served_log(self.address, plan.total, self.context)
        finally:
            self.stop()
        report = self.check_history(complete=True)
        history = self.history(complete=True)
        assert served == history.committed, f"served log != stored log: {self.context()}"
        assert sorted(history.committed) == list(range(1, plan.total + 1)), self.context()
        self.check_producer_business_rows(history.committed)
        self.figures.records = report.records
        self.figures.report = report
        self.figures.seconds = time.monotonic() - started
        return self.figures

    def check_producer_business_rows(self, records: dict[int, bytes]) -> None:
        """The producer never half-committed a transaction: its orders match its log."""
        with sqlite3.connect(self.producer_db) as db:
            orders = dict(db.execute("SELECT id, amount FROM orders").fetchall())
            totals = db.execute("SELECT n, amount FROM totals WHERE name = 'orders'").fetchone()
            head = db.execute(HEAD_QUERY, (STREAM,)).fetchone()
        db.close()
        context = self.context()
        assert head == (self.plan.total,), f"head {head}: {context}"
        published: Counter[int] = Counter()
        for seq, value in records.items():
            name, _, amount = value.decode().partition(":")
            order_id = int(name.removeprefix("order-"))
            published[order_id] += 1
            assert orders.get(order_id) == int(amount), (
                f"seq {seq} = {value!r}, order {orders.get(order_id)}: {context}"
            )
        assert max(published.values()) == 1, f"orders published twice: {context}"
        assert set(published) == set(orders), f"orders and log differ: {context}"
        assert totals == (self.plan.total, sum(orders.values())), f"totals {totals}: {context}"


def served_log(address: str, total: int, context: Callable[[], str]) -> dict[int, bytes]:
    """Every record of the stream, as the producer serves it."""
    records: dict[int, bytes] = {}
    with streamq.Client(address, timeout=20) as client:
        info = client.head(STREAM)
        assert info.head == total, f"{info}: {context()}"
        for batch in client.read_range(STREAM, 1, total + 1):
            for record in batch:
                assert record.seq not in records, f"seq {record.seq} served twice: {context()}"
                records[record.seq] = record.value
    return records


def seed_from_env() -> int:
    return int(os.environ.get("STREAMQ_CRASH_SEED") or random.randrange(2**32))


def describe(figures: Figures) -> str:
    """One run's figures, as the suites print them."""
    faults = ", ".join(f"{kind} {n}" for kind, n in sorted(figures.faults.items()))
    return (
        f"faults injected {sum(figures.faults.values())} ({figures.kills} kills; {faults}), "
        f"records checked {figures.records} (oracle run {figures.checks} times), "
        f"anomalies {figures.anomalies}; seed {figures.seed}, {figures.seconds:.1f} s"
    )
