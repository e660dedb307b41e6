"""Exactly-once under kill -9 and SIGSTOP: the harness behind test_crash.py and ``make soak``.

A producer process (tests/crash/producer_proc.py) publishes orders together with its
business rows; consumer processes (tests/crash/consumer_proc.py) apply them into their
own database with the oracle's non-idempotent effect. A run SIGKILLs consumers at random
moments and at named fault points (before the transaction, after applying but before
COMMIT, right after COMMIT), and producers at random moments, in the middle of a
transaction and in the middle of pushing a frame; it also freezes either side with
SIGSTOP for longer than every timeout (the consumer's heartbeat and connect timeouts, the
producer's handshake and idle timeouts) before SIGCONT. Each killed process is restarted
on the same databases (the producer on the same port). After every kill the oracle
(tests/oracle.py) checks the history so far, and at the end the whole of it: every
committed record applied exactly once, in order, nothing phantom, the stored position and
sum agreeing with the effects; and the producer's business rows match its log one to one.

Two engines (``engine``, or STREAMQ_CRASH_ENGINE for ``make soak``): ``sqlite``, both
databases SQLite files; ``postgres``, both PostgreSQL databases (``producer`` and
``consumer``) on a throwaway server of the run's own (tests/pgserver.py). A PostgreSQL run
also SIGKILLs the server's postmaster a few times (``Plan.server_kills``) and starts it
again on the same data directory and port, and runs other writer processes
(tests/crash/writer_proc.py, ``Plan.writers``) that publish into the same stream with
``streamq.publish`` on their own psycopg connections, their orders in the same business
tables, some killed at random and some mid-transaction, each restarted like the producer.
There a publish returns a ``Receipt``, not a seq: the serving producer numbers the
records once committed. The writers journal their records by value, and the harness
finds each transaction they committed in the log, or still pending (not numbered yet),
in one snapshot of both (``check_unnumbered_commits``): every record exactly once, a
transaction's records at consecutive seqs in publish order, a writer's transactions in
the order it committed them; at the end nothing is left pending. The producer journals
the seqs ``wait_served`` gives its commits.
Server kills are survived, not restarted around: the producer, the consumer and the
writers run with ``--survive-db-outages`` and carry on by themselves (the producer's and
the consumer's connections open again inside streamq; a transaction cut by the kill is
given up, or for the consumer applied again; see the programs), and every other fault
goes on as on SQLite. Their ``DBERROR``/``RESUME``/``RETRY`` lines are counted in the
figures.

Set STREAMQ_CRASH_SEED to replay a run; the seed is in every failure message.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import streamq
from bench.common import reserved_port
from streamq.protocol import decode_record

from .crash.producer_proc import COMMIT_UNNUMBERED
from .oracle import (
    POSTGRES,
    History,
    Report,
    check,
    dialect,
    history_from_files,
    read_head,
    read_log,
)
from .pgserver import PostgresServer

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
# Records beyond the kill phase's cap (of the 1,000 kept from it) released while a fault
# still needs some published: the producer's death mid-push, the server's kill under a
# held transaction. Without them, that fault would wait forever. (Mid-transaction deaths
# need none: at the cap, a program waiting for records runs the killing transaction.)
FAULT_RESERVE = 500

CONSUMER_FAULTS = ("random", "before-tx", "after-apply", "after-commit")
ENGINES = ("sqlite", "postgres")
ENGINE_ENV = "STREAMQ_CRASH_ENGINE"
WAL_ENV = "STREAMQ_CRASH_WAL"  # 1: PostgreSQL publishing through the WAL
# PostgreSQL runs: the chance a round kills the server, how long it then stays down, and
# how long the programs keep surviving consecutive database errors (far above that).
SERVER_KILL_CHANCE = 0.15
# When the server is killed: while the producer, the consumer or another writer is held in
# the middle of a transaction (its records published or its effects written, COMMIT not
# sent yet; tests/crash/faults.py HOLDS), or at a random moment of a round.
SERVER_KILL_MOMENTS = ("producer-tx", "consumer-tx", "writer-tx", "random")
SERVER_DOWN_SECONDS = (0.0, 1.0)
SURVIVE_DB_OUTAGES = 30.0
WRITER_KILL_CHANCE = 0.3
WRITER_PACE = 20.0  # transactions per second of each other writer, 1 to 5 records each
# Lines of the programs that say they survived something (the figures count them).
RECOVERY_LINES = ("DBERROR", "RESUME", "RETRY")


@dataclass(frozen=True)
class Plan:
    """How many faults of each kind one run delivers."""

    total: int = 12_000  # records published in all
    consumer_kills: int = 32  # at least, spread over CONSUMER_FAULTS
    producer_lives: tuple[str, ...] = ("mid-tx", "mid-push", "external") * 2
    pauses: tuple[str, ...] = ("producer", "consumer")
    max_rounds: int = 90
    # kill -9 of the database server, at each of SERVER_KILL_MOMENTS in turn: None is the
    # engine's default (SQLite has none, PostgreSQL one at each moment).
    server_kills: int | None = None
    # Other writer processes (streamq.publish): None is the engine's default (SQLite
    # none, so that run stays as it was; PostgreSQL 2). Their lives, as the producer's.
    writers: int | None = None
    writer_lives: tuple[str, ...] = ("mid-tx", "external") * 2

    @property
    def kill_phase_cap(self) -> int:
        """Records published while killing: the consumer never finishes early."""
        return self.total - 1_000

    def resolved(self, engine: str) -> Plan:
        """This plan with the engine's defaults filled in."""
        if engine not in ENGINES:
            raise ValueError(f"engine {engine!r}: one of {', '.join(ENGINES)}")
        postgres = engine == "postgres"
        default = len(SERVER_KILL_MOMENTS) if postgres else 0
        server_kills = default if self.server_kills is None else self.server_kills
        if server_kills and not postgres:
            raise ValueError("server_kills: only a PostgreSQL run has a server to kill")
        writers = (2 if postgres else 0) if self.writers is None else self.writers
        return replace(self, server_kills=server_kills, writers=writers)


@dataclass
class Figures:
    """What a run did: faults by kind, records checked, anomalies found."""

    seed: int
    faults: Counter[str] = field(default_factory=Counter)
    records: int = 0
    checks: int = 0
    report: Report | None = None
    seconds: float = 0.0
    engine: str = "sqlite"
    recoveries: Counter[str] = field(default_factory=Counter)  # DBERROR, RESUME, RETRY lines
    writer_records: int = 0  # records committed by the other writers

    @property
    def kills(self) -> int:
        return sum(n for kind, n in self.faults.items() if "pause" not in kind)

    @property
    def anomalies(self) -> int:
        return self.report.anomalies if self.report else 0


class Proc:
    """A program of tests/crash, its output going to a log file."""

    def __init__(
        self, program: str, args: list[str], log: Path, fault: str = "", hold: str = ""
    ) -> None:
        self.log = log
        # A server kill this process is armed for (its STREAMQ_HOLD), and whether it was
        # delivered and the process continued.
        self.moment = ""
        self.released = False
        paths = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), STREAMQ_FAULT=fault)
        env["STREAMQ_HOLD"] = hold
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

    def wait_line(
        self,
        prefix: str,
        timeout: float,
        context: Callable[[], str],
        meanwhile: Callable[[], None] | None = None,
    ) -> str:
        """The first output line starting with ``prefix``, waiting for it up to ``timeout``
        (calling ``meanwhile`` while it waits: another process may be waiting for the test)."""
        deadline = time.monotonic() + timeout
        while (line := self.line(prefix)) is None:
            assert self.alive(), (
                f"{self.log.name} exited ({self.popen.returncode}) before {prefix!r}: {context()}"
            )
            assert time.monotonic() < deadline, (
                f"no {prefix!r} from {self.log.name} within {timeout} s: {context()}"
            )
            if meanwhile is not None:
                meanwhile()
            time.sleep(0.01)
        return line

    @property
    def armed(self) -> bool:
        """Set to hold for a server kill not delivered yet: the test does not kill it."""
        return bool(self.moment) and not self.released

    def held(self) -> bool:
        """Stopped at its hold point, waiting for the test (faults.py, ``HOLDS``)."""
        return self.armed and self.line("HOLD") is not None

    def stopped(self) -> bool:
        """SIGSTOPped (Linux: /proc; elsewhere assumed once it said so)."""
        try:
            stat = Path(f"/proc/{self.popen.pid}/stat").read_text()
        except FileNotFoundError:
            return sys.platform != "linux"
        return stat.rpartition(")")[2].split()[0] in ("T", "t")

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


@dataclass
class WriterSlot:
    """One of the other writers: its current process and what its life is for."""

    number: int
    proc: Proc | None = None
    life: str = ""
    starts: int = 0
    done: bool = False  # exited 0 once the stream was complete


def engine_from_env() -> str:
    return os.environ.get(ENGINE_ENV) or "sqlite"


def last_journal_records(path: Path) -> list[tuple[int, bytes]]:
    """The records of a journal's last line: the transaction a fault point killed (its
    seqs 0 where they are given after the commit, PostgreSQL)."""
    lines = path.read_text().splitlines() if path.exists() else []
    if not lines:
        return []
    event = json.loads(lines[-1])
    assert event["event"] == "publish", f"{path.name} ends with {event}"
    return [(int(seq), value.encode("latin-1")) for seq, value in event["records"]]


def journal_transactions(path: Path, event: str) -> list[list[bytes]]:
    """The values of each ``event`` line of a journal, in order (a truncated last line,
    a kill mid-write, is skipped)."""
    found = []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if entry["event"] == event:
            found.append([value.encode("latin-1") for _, value in entry["records"]])
    return found


def read_published(db: str, stream: str) -> tuple[dict[int, bytes], list[bytes]]:
    """A stream's numbered records (seq -> value) and the values of its committed records
    not numbered yet (PostgreSQL's ``streamq_pending``), in one snapshot: the serving
    producer moves records from one to the other in a transaction, so each committed
    record is in exactly one of them. SQLite numbers at publish: nothing is pending."""
    if dialect(db) is not POSTGRES:
        return read_log(db, stream), []
    with POSTGRES.connect(db, snapshot=True) as conn:
        rows = conn.execute(
            "SELECT l.seq, l.record FROM streamq_log AS l "
            "JOIN streamq_streams AS s ON s.id = l.stream_id WHERE s.name = %s",
            (stream,),
        ).fetchall()
        pending = conn.execute(
            "SELECT record FROM streamq_pending WHERE stream = %s ORDER BY xid, id", (stream,)
        ).fetchall()
    log = {}
    for seq, encoded in rows:
        record = decode_record(bytes(encoded))
        assert record.seq == seq, (record.seq, seq)
        log[int(seq)] = bytes(record.value)
    return log, [bytes(decode_record(bytes(encoded)).value) for (encoded,) in pending]


class CrashRun:
    def __init__(
        self,
        directory: Path,
        seed: int,
        plan: Plan,
        engine: str | None = None,
        *,
        wal: bool | None = None,
    ) -> None:
        self.dir = directory
        self.engine = engine or engine_from_env()
        # PostgreSQL with wal_level = logical: records published through the WAL
        # (engines/postgres/walpath.py), not the pending table.
        self.wal = os.environ.get(WAL_ENV) == "1" if wal is None else wal
        self.plan = plan = plan.resolved(self.engine)
        self.figures = Figures(seed, engine=self.engine)
        self.rng = random.Random(seed)
        # The producer's port, held through every restart: set by ``run``.
        self.port = 0
        self.address = ""
        # PostgreSQL: URLs once the run's server is up (``open_databases``).
        self.server: PostgresServer | None = None
        self.producer_db = str(directory / "producer.db")
        self.consumer_db = str(directory / "consumer.db")
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
        self.writers = [WriterSlot(number) for number in range(1, (plan.writers or 0) + 1)]
        moments = [m for m in SERVER_KILL_MOMENTS if self.writers or m != "writer-tx"]
        # The server kills still to deliver.
        self.server_moments = [moments[i % len(moments)] for i in range(plan.server_kills or 0)]
        self.rng.shuffle(self.server_moments)
        self.writer_lives = list(plan.writer_lives) if self.writers else []
        self.rng.shuffle(self.writer_lives)
        self.starts = {"producer": 0, "consumer": 0}
        self.position = 0
        self.events: list[str] = []

    @property
    def faults(self) -> Counter[str]:
        return self.figures.faults

    @property
    def survive(self) -> list[str]:
        """The programs' option to carry on through the server's kills, if there are any."""
        if not self.plan.server_kills:
            return []
        return ["--survive-db-outages", str(SURVIVE_DB_OUTAGES)]

    def context(self) -> str:
        return (
            f"seed={self.figures.seed} (STREAMQ_CRASH_SEED), engine {self.engine}, logs in "
            f"{self.dir}, faults {dict(self.faults)}; last events:\n  "
            + "\n  ".join(self.events[-12:])
        )

    def event(self, text: str) -> None:
        self.events.append(f"{time.monotonic():.3f} {text}")

    def allow(self, records: int) -> None:
        self.allowed = min(records, self.plan.total)
        tmp = self.allow_file.with_suffix(".tmp")
        tmp.write_text(str(self.allowed))
        tmp.replace(self.allow_file)

    def cap(self) -> int:
        """Records the kill phase may publish; a little more while a planned fault needs
        records to publish, push or apply (``FAULT_RESERVE``)."""
        holds = any(moment != "random" for moment in self.server_moments)
        waits = holds or self.producer_life == "mid-push"  # (mid-tx: --kill-waiting-from)
        return self.plan.kill_phase_cap + (FAULT_RESERVE if waits else 0)

    def release(self, records: int) -> None:
        """Let ``records`` more be published, up to the kill phase's cap."""
        self.allow(max(self.allowed, min(self.allowed + records, self.cap())))

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
        """The oracle on everything so far, and the commits journalled without seqs; any
        anomaly fails the run at once."""
        self.check_unnumbered_commits(complete)
        report = check(self.history(complete))
        self.figures.checks += 1
        assert report.ok, f"{report}: {self.context()}"
        return report

    def check_unnumbered_commits(self, complete: bool) -> None:
        """The transactions the writers committed and journalled by value (PostgreSQL: a
        publish says no seq), found in the log or pending, read after the journals: each
        record exactly once in all; a transaction numbered whole, at consecutive seqs in
        publish order; each writer's transactions (one after another, each committed
        before the next began, a restarted one's after its last life's) numbered in that
        order, at increasing seqs. ``complete``:
        nothing committed is left pending."""

        # Per program (``writer-2`` of ``writer-2-3.jsonl``), its lives in order: a life
        # starts once the one before ended.
        def life(path: Path) -> tuple[str, int]:
            program, _, number = path.stem.rpartition("-")
            return program, int(number)

        commits: dict[str, list[list[bytes]]] = {}
        for path in sorted(self.dir.glob("*.jsonl"), key=life):
            transactions = journal_transactions(path, COMMIT_UNNUMBERED)
            commits.setdefault(life(path)[0], []).extend(transactions)
        log, pending = read_published(self.producer_db, STREAM)
        context = self.context
        where = Counter(pending)
        seq_of: dict[bytes, int] = {}
        for seq, value in log.items():
            where[value] += 1
            seq_of[value] = seq
        twice = [value for value, n in where.items() if n > 1]
        assert not twice, f"records in the log or pending twice, e.g. {twice[:3]}: {context()}"
        if complete:
            assert not pending, f"{len(pending)} committed records never numbered: {context()}"
        for name, transactions in commits.items():
            last = 0  # the last seq of the writer's last numbered transaction
            waiting: list[bytes] | None = None  # its first transaction not numbered yet
            for values in transactions:
                lost = [value for value in values if not where[value]]
                if self.wal and not complete and len(lost) == len(values):
                    waiting = waiting or values  # committed, in the WAL, not numbered yet
                    continue
                assert not lost, (
                    f"{name}: committed {values}, {len(lost)} of them neither in the log nor "
                    f"pending: {context()}"
                )
                seqs = [seq_of[value] for value in values if value in seq_of]
                if not seqs:
                    waiting = waiting or values
                    continue
                assert len(seqs) == len(values), (
                    f"{name}: {values} partly numbered, at {seqs}: {context()}"
                )
                assert waiting is None, (
                    f"{name}: {values} numbered, an earlier transaction not: {waiting}: {context()}"
                )
                assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), (
                    f"{name}: one transaction's records at seqs {seqs}: {context()}"
                )
                assert seqs[0] > last, (
                    f"{name}: a transaction at seqs {seqs} after one at {last}: {context()}"
                )
                last = seqs[-1]

    # --- the database server (PostgreSQL) ------------------------------------

    def open_databases(self) -> None:
        """PostgreSQL: the run's own server, and a database for each side."""
        if self.engine != "postgres":
            return
        logical = {"wal_level": "logical", "max_replication_slots": "10"}
        self.server = PostgresServer(settings=logical if self.wal else None)
        self.server.start()
        self.producer_db = self.server.create_database("producer")
        self.consumer_db = self.server.create_database("consumer")
        path = "the WAL" if self.wal else "the pending table"
        self.event(f"postgres: serving on port {self.server.port}, publishing through {path}")

    def close_databases(self) -> None:
        if self.server is not None:
            # Its directory goes with it: keep its log with the programs'.
            shutil.copyfile(self.server.logfile, self.dir / "postgres.log")
            self.server.stop()

    def kill_server(self, moment: str) -> None:
        """SIGKILL the postmaster, leave it down a moment, start it again (crash recovery)
        on the same data directory and port. The programs carry on by themselves."""
        server = self.server
        assert server is not None
        server.kill()
        self.server_moments.remove(moment)
        self.faults[f"postgres kill {moment}"] += 1
        self.event(f"postgres: killed (pid {server.killed_pid}) at {moment}")
        time.sleep(self.rng.uniform(*SERVER_DOWN_SECONDS))  # fault injection: down this long
        server.restart()
        self.event("postgres: restarted")

    def procs(self) -> list[Proc]:
        procs = [self.producer, self.consumer, *(slot.proc for slot in self.writers)]
        return [proc for proc in procs if proc is not None]

    def arm(self, moment: str, hold: str) -> str:
        """``hold`` (a STREAMQ_HOLD) for the process about to start, if the server is still
        to be killed at ``moment`` and no running process is armed for it; else ''."""
        armed = any(p.moment == moment and p.armed and p.alive() for p in self.procs())
        return hold if moment in self.server_moments and not armed else ""

    def release_holds(self) -> None:
        """A process held in its transaction: kill the server under it, then continue it."""
        for proc in self.procs():
            if not proc.alive() or not proc.held():
                continue
            deadline = time.monotonic() + 10
            while not proc.stopped():
                assert proc.alive() and time.monotonic() < deadline, (
                    f"{proc.log.name} said HOLD and did not stop: {self.context()}"
                )
                time.sleep(0.01)
            self.event(f"{proc.log.name}: {proc.line('HOLD')}")
            self.kill_server(proc.moment)
            proc.released = True
            proc.popen.send_signal(signal.SIGCONT)

    # --- the producer --------------------------------------------------------

    def start_producer(self) -> None:
        self.producer_life = self.lives.pop() if self.lives else "final"
        args = [self.producer_db, str(self.port), str(self.plan.total)]
        args += ["--allow", str(self.allow_file), "--pace", str(PACE)]
        args += ["--seed", str(self.rng.randrange(2**32)), *self.survive]
        args += ["--kill-waiting-from", str(self.plan.kill_phase_cap)]
        self.starts["producer"] += 1
        number = self.starts["producer"]
        args += ["--journal", str(self.dir / f"producer-{number}.jsonl")]
        fault = ""
        if self.producer_life == "mid-tx":
            fault = f"mid-tx:{self.rng.randint(1, 10)}"
        elif self.producer_life == "mid-push":
            fault = f"mid-push:{self.rng.randint(1, 4)}"
        hold = ""
        if self.producer_life != "mid-tx":  # else it may die first
            hold = self.arm("producer-tx", f"mid-tx:{self.rng.randint(1, 2)}")
        name = f"producer-{number}.log"
        self.producer = Proc("producer_proc.py", args, self.dir / name, fault, hold)
        self.producer.moment = hold and "producer-tx"
        ready = self.producer.wait_line("READY", STARTUP_TIMEOUT, self.context, self.release_holds)
        self.event(f"{name} ({self.producer_life} {fault} {hold}): {ready}")

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
        if life == "mid-tx":
            self.check_killed_transaction(producer)
        self.start_producer()
        if life == "mid-tx" and self.engine == "sqlite" and not self.writers:
            # Nothing of the killed transaction was committed: the head is where it began.
            head_at_kill = fired.split("head=")[1].split()[0]
            assert self.producer is not None
            ready = self.producer.line("READY")
            assert ready is not None and ready.endswith(f"head={head_at_kill}"), (
                f"{ready} after {fired}: {self.context()}"
            )

    def check_killed_transaction(self, proc: Proc) -> None:
        """Nothing a program's transaction killed before COMMIT published is in the log.
        Checked before it is restarted: nobody else publishes its values (its order ids
        are its own), so any of them there would be the killed transaction's."""
        killed = {value for _, value in last_journal_records(proc.log.with_suffix(".jsonl"))}
        assert killed, f"{proc.log.name}: no transaction journalled before the kill"
        log, pending = read_published(self.producer_db, STREAM)
        committed = killed & {*log.values(), *pending}
        assert not committed, (
            f"{proc.log.name}: {len(committed)} records of the transaction killed before "
            f"COMMIT are in the log or pending, e.g. {sorted(committed)[:3]}: {self.context()}"
        )

    def kill_producer(self) -> None:
        assert self.producer is not None
        if self.producer.kill():
            self.faults["producer random"] += 1
            self.event(f"{self.producer.log.name}: killed")
            self.start_producer()
        else:
            self.tend_producer()

    # --- the other writers (streamq.publish) ----------------------------------

    def start_writer(self, slot: WriterSlot) -> None:
        slot.life = self.writer_lives.pop() if self.writer_lives else "final"
        slot.starts += 1
        stem = f"writer-{slot.number}-{slot.starts}"
        args = [self.producer_db, str(slot.number), str(self.plan.total)]
        args += ["--allow", str(self.allow_file), "--pace", str(WRITER_PACE)]
        args += ["--seed", str(self.rng.randrange(2**32)), *self.survive]
        args += ["--journal", str(self.dir / f"{stem}.jsonl")]
        args += ["--kill-waiting-from", str(self.plan.kill_phase_cap)]
        fault = hold = ""
        if slot.life == "mid-tx":
            fault = f"mid-tx:{self.rng.randint(1, 10)}"
        else:
            hold = self.arm("writer-tx", f"mid-tx:{self.rng.randint(1, 3)}")
        slot.proc = Proc("writer_proc.py", args, self.dir / f"{stem}.log", fault, hold)
        slot.proc.moment = hold and "writer-tx"
        ready = slot.proc.wait_line("READY", STARTUP_TIMEOUT, self.context, self.release_holds)
        self.event(f"{stem}.log ({slot.life} {fault} {hold}): {ready}")

    def tend_writers(self) -> None:
        """Restart the writers that killed themselves at their fault point."""
        for slot in self.writers:
            proc = slot.proc
            if proc is None or proc.alive() or slot.done:
                continue
            rc = proc.popen.returncode
            fired = proc.line("FAULT")
            if rc == 0 and proc.line("COMPLETE"):
                slot.done = True
                continue
            assert rc == -signal.SIGKILL and fired and fired.split()[1] == slot.life, (
                f"{proc.log.name} ({slot.life}) exited with {rc}:\n{proc.tail()}\n{self.context()}"
            )
            self.faults[f"writer {slot.life}"] += 1
            self.event(f"{proc.log.name}: {fired}")
            self.check_killed_transaction(proc)
            self.start_writer(slot)

    def kill_writers(self) -> None:
        """Kill, now and then, the writers whose life ends that way."""
        for slot in self.writers:
            if slot.life != "external" or self.rng.random() >= WRITER_KILL_CHANCE:
                continue
            assert slot.proc is not None
            if slot.proc.armed:
                continue
            time.sleep(self.rng.uniform(0.05, 0.3))  # fault injection
            if slot.proc.kill():
                self.faults["writer random"] += 1
                self.event(f"{slot.proc.log.name}: killed")
                self.start_writer(slot)

    def writers_pending(self) -> bool:
        return any(slot.life != "final" for slot in self.writers)

    def finish_writers(self) -> None:
        """Once the stream is complete, every writer finds it so and exits 0."""
        for slot in self.writers:
            proc = slot.proc
            assert proc is not None
            rc = proc.wait(timeout=STARTUP_TIMEOUT)
            assert rc == 0 and proc.line("COMPLETE"), (
                f"{proc.log.name}: exit {rc}:\n{proc.tail()}\n{self.context()}"
            )
            slot.done = True

    # --- the consumer --------------------------------------------------------

    def start_consumer(self, fault: str = "", hold: str = "") -> Proc:
        args = [self.address, self.consumer_db, str(self.plan.total)]
        args += ["--heartbeat-timeout", str(HEARTBEAT_TIMEOUT)]
        args += ["--connect-timeout", str(CONNECT_TIMEOUT), *self.survive]
        self.starts["consumer"] += 1
        number = self.starts["consumer"]
        args += ["--journal", str(self.dir / f"consumer-{number}.jsonl")]
        name = f"consumer-{number}.log"
        self.event(f"{name}: start, fault {fault or '-'} {hold}")
        self.consumer = Proc("consumer_proc.py", args, self.dir / name, fault, hold)
        self.consumer.moment = hold and "consumer-tx"
        return self.consumer

    def pause_one(self) -> None:
        """Freeze the producer or the consumer for longer than every timeout."""
        who = self.pauses.pop()
        proc = self.producer if who == "producer" else self.consumer
        assert proc is not None
        # Not one armed to hold: a pause's SIGCONT would continue it from its hold.
        if not proc.armed and proc.pause(self.rng.uniform(*PAUSE_SECONDS)):
            self.faults[f"{who} pause"] += 1
            self.event(f"{proc.log.name}: paused")
        else:
            self.pauses.append(who)

    def tend(self) -> None:
        self.release_holds()
        self.tend_producer()
        self.tend_writers()

    def round(self) -> None:
        self.tend()
        self.release(CHUNK)
        kind = self.consumer_faults.pop() if self.consumer_faults else "random"
        at = self.rng.randint(1, 4)
        fault = "" if kind == "random" else f"{kind}:{at}"
        # Held in its first transaction if it waits for a fault point of a later one.
        hold = self.arm("consumer-tx", "after-apply:1") if kind != "random" and at > 1 else ""
        consumer = self.start_consumer(fault, hold)
        if self.pauses and self.rng.random() < 0.3:
            time.sleep(self.rng.uniform(0.05, 0.5))  # fault injection, not synchronization
            self.pause_one()
        if "random" in self.server_moments and self.rng.random() < SERVER_KILL_CHANCE:
            time.sleep(self.rng.uniform(0.05, 0.5))  # fault injection
            self.kill_server("random")
        self.kill_writers()
        # At the cap, a producer whose life ends otherwise than by a kill from here or in
        # a transaction (which it then runs at once) would wait for records forever.
        stuck = self.producer_life not in ("external", "mid-tx") and self.allowed >= self.cap()
        external = self.producer_life == "external" and self.rng.random() < 0.3
        assert self.producer is not None
        if (external or stuck) and not self.producer.armed:
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
        while consumer.wait(timeout=0.2) is None:
            assert time.monotonic() < deadline, (
                f"{consumer.log.name} neither reached {point} nor exited in 30 s:\n"
                f"{consumer.tail()}\n{self.context()}"
            )
            self.tend()
            if consumer_progress(consumer) < self.allowed:
                continue
            if self.allowed < self.cap():
                self.release(TICK)
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

    def faults_pending(self) -> bool:
        return (
            self.consumer_kills() < self.plan.consumer_kills
            or self.producer_life != "final"
            or bool(self.pauses)
            or bool(self.server_moments)
            or self.writers_pending()
        )

    def stop(self) -> None:
        for proc in self.procs():
            proc.kill()
            proc.wait(timeout=10)

    # --- the whole run -------------------------------------------------------

    def run(self) -> Figures:
        with reserved_port() as port:
            self.port, self.address = port, f"127.0.0.1:{port}"
            return self._run()

    def _run(self) -> Figures:
        started = time.monotonic()
        plan = self.plan
        try:
            self.open_databases()
            try:
                self.allow(0)
                self.start_producer()
                for slot in self.writers:
                    self.start_writer(slot)
                rounds = 0
                while self.faults_pending():
                    rounds += 1
                    assert rounds <= plan.max_rounds, (
                        f"faults still missing after {plan.max_rounds} rounds: {self.context()}"
                    )
                    self.round()

                # Let them all run to completion.
                self.tend()
                self.allow(plan.total)
                consumer = self.start_consumer()
                rc = consumer.wait(timeout=LAST_RUN_TIMEOUT)
                assert rc == 0, f"last consumer: exit {rc}:\n{consumer.tail()}\n{self.context()}"
                assert consumer.line("DONE") == f"DONE applied={plan.total}", self.context()
                assert self.producer is not None
                self.producer.wait_line("COMPLETE", STARTUP_TIMEOUT, self.context)
                self.finish_writers()
                served = served_log(self.address, plan.total, self.context)
            finally:
                self.stop()
            report = self.check_history(complete=True)
            history = self.history(complete=True)
            assert served == history.committed, f"served log != stored log: {self.context()}"
            assert sorted(history.committed) == list(range(1, plan.total + 1)), self.context()
            self.check_producer_business_rows(history.committed)
        finally:
            self.close_databases()
        self.figures.records = report.records
        self.figures.report = report
        self.figures.writer_records = sum(
            1 for value in history.committed.values() if value.startswith(b"order--")
        )
        self.figures.recoveries = self.recoveries()
        self.figures.seconds = time.monotonic() - started
        return self.figures

    def recoveries(self) -> Counter[str]:
        """The lines in which the programs say they survived a database outage."""
        found: Counter[str] = Counter()
        for log in self.dir.glob("*-*.log"):
            for line in log.read_text(errors="replace").splitlines():
                word = line.split(" ", 1)[0]
                if word in RECOVERY_LINES:
                    found[f"{log.name.split('-')[0]} {word}"] += 1
        return found

    def check_producer_business_rows(self, records: dict[int, bytes]) -> None:
        """No transaction (the producer's, or another writer's) half-committed: the orders
        match the log."""
        d = dialect(self.producer_db)
        with d.connect(self.producer_db, snapshot=True) as db:
            orders = dict(db.execute("SELECT id, amount FROM orders").fetchall())
            totals = db.execute("SELECT n, amount FROM totals WHERE name = 'orders'").fetchone()
        head = read_head(self.producer_db, STREAM)
        context = self.context()
        assert head == self.plan.total, f"head {head}: {context}"
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
        assert tuple(totals) == (self.plan.total, sum(orders.values())), (
            f"totals {totals}: {context}"
        )


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
    extra = ""
    if figures.engine != "sqlite":
        survived = ", ".join(f"{kind} {n}" for kind, n in sorted(figures.recoveries.items()))
        extra = (
            f"; engine {figures.engine}: {figures.writer_records} records by the other "
            f"writers, survived outages ({survived or 'none'})"
        )
    return (
        f"faults injected {sum(figures.faults.values())} ({figures.kills} kills; {faults}), "
        f"records checked {figures.records} (oracle run {figures.checks} times), "
        f"anomalies {figures.anomalies}; seed {figures.seed}, {figures.seconds:.1f} s{extra}"
    )
