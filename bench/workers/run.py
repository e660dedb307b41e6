"""The workers workload's driver: a service of 1, 2, 4 and 8 worker processes on ONE
database.

Each worker commits orders on its own sqlite3 connection, one ``BEGIN IMMEDIATE``
transaction per order: a business row and its event (processes in ``bench/workers/``).
Two systems, side by side in one run:

- **streamq**: the event is ``streamq.publish(conn, ...)``; ``streamq serve`` (its own
  process) notices the workers' commits through the WAL and pushes them to a
  ``streamq.Consumer`` process.
- **Kafka + outbox**: the event is an outbox row; the transfer workload's relay ships the
  outbox to the Kafka broker, a confluent-kafka consumer process reads the topic.

Measured per worker count, with every worker as fast as it can: delivered/s, from the
workers' common start (their first commit) to the consumer's receipt of the last order
(the consumer's work here is its receipt, the same for both: it keeps each order's
position and id), the figure the systems are compared by; beside it commits/s, to the
last worker's last COMMIT, which stops before the relay and the consumer are done
(Kafka's relay takes up to 5,000 rows, waits for their acknowledgements, then saves its
position: its consumer trailed the last commit by tens to hundreds of milliseconds, so
a clock stopped at the commit left most of Kafka's delivery out). Then the refused
transactions (any exception in a worker; expected: 0), and the latency from each order's
due time to its receipt by the consumer at a paced 2,000 orders/s spread over the
workers (no coordinated omission). After every run the consumer's receipts are checked
against the ``orders`` table: each committed order received once, positions dense, in
commit order. Then the synchronous path alone, in one process with no server and
nothing reading: orders/s of ``SyncProducer`` transactions, of ``streamq.publish`` on a
plain connection and of plain sqlite3 (an outbox row instead of the publish: the outbox
alone, a ceiling rather than a peer), from 1 and 8 threads.

Every connection runs with ``PRAGMA synchronous=NORMAL`` (read back and printed).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import sqlite3
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.progress import Progress, TaskID
from rich.table import Table

from streamq.engines.sqlite.storage import HEAD_QUERY

from ..common import (
    Child,
    LatencyRuns,
    Series,
    alternating,
    console,
    latency_table,
    percentile_series,
    proc_cpu_seconds,
    save,
    workload_main,
)
from ..measure import Latencies
from ..transfer.kafka import KAFKA_PRODUCER, RELAY_POLL, warm_up
from .common import STREAM, SYNC_VARIANTS, setup_database

PROGRAMS = {"streamq": "bench.workers.streamq", "kafka": "bench.workers.kafka"}
NORMAL = 1  # PRAGMA synchronous
STARTUP_TIMEOUT = 60.0  # s for a process to say READY
GO_DELAY = 0.2  # s between GO and the workers' common start, so that all start together
DRAIN_TIMEOUT = 120.0  # s, after the workers' last commit, for the consumer to receive all
LATENCY_GOAL_US = 5_000  # p99 with 8 workers at the paced rate
SYNC_GOAL = 0.5  # streamq's sync path, at least this fraction of plain sqlite3's rate


@dataclass(frozen=True)
class Sizes:
    workers: tuple[int, ...]
    orders: int  # per run as fast as possible, over all workers
    rate: int  # orders/s over all workers, for latency
    seconds: float  # of each paced run
    sync_orders: int  # per run of the synchronous path
    sync_threads: tuple[int, ...]


FULL = Sizes((1, 2, 4, 8), 40_000, 2_000, 10.0, 40_000, (1, 8))
QUICK = Sizes((1, 2, 4, 8), 4_000, 2_000, 2.0, 5_000, (1, 8))


@dataclass(frozen=True)
class Run:
    """One run of a service: its workers, its server or relay, its consumer."""

    system: str
    workers: int
    rate: float
    commits_per_s: float  # from the common start to the last worker's last commit
    # Timed orders received / from the common start to the consumer's last receipt: can
    # exceed commits/s only by the moment between the last COMMIT reaching the log and its
    # worker reading its clock (the consumer may receive it in between).
    delivered_per_s: float
    # s from the common start: the last committed order begun, the last COMMIT returned,
    # the consumer's last receipt (always after the first: no order arrives before its
    # transaction began).
    clock: dict[str, float]
    committed: int
    refused: int
    errors: list[str]  # exception type:count, per worker that had any
    latency: list[int]  # due -> receipt: p50, p99, p99.9, max (microseconds), count
    commit_latency: list[int]  # due -> COMMIT returned in the worker, the same figures
    cpu_seconds: dict[str, float]  # all workers, the server (streamq) or relay (kafka), consumer
    check: dict[str, Any]


def run_once(
    system: str,
    folder: Path,
    workers: int,
    orders: int,
    rate: float = 0,
    broker: Any = None,
    drain_timeout: float = DRAIN_TIMEOUT,
) -> Run:
    """``orders`` orders from ``workers`` worker processes, received by one consumer.

    ``rate`` (orders/s over all workers) paces them; 0: as fast as they can. The consumer
    reports what it received by ``drain_timeout`` after the last commit (the check then
    names what is missing). Every process started here is stopped before it returns,
    whatever happens.
    """
    if system not in PROGRAMS:
        raise ValueError(f"system {system!r}: choose from {sorted(PROGRAMS)}")
    if system == "kafka" and broker is None:
        raise ValueError("kafka needs a broker")
    folder.mkdir(parents=True, exist_ok=True)
    db, received = folder / "service.db", folder / "received.db"
    setup_database(str(db), log=system == "streamq")
    per_worker = orders // workers
    limit = STARTUP_TIMEOUT + (2 * orders / rate if rate > 0 else 300.0)
    with contextlib.ExitStack() as stack:
        if system == "streamq":
            server = stack.enter_context(Child("streamq", "serve", db, "--init", "--port", 0))
            address = server.expect("serving", STARTUP_TIMEOUT)[-1]
            consumer_args: list[object] = ["consumer", address]
        else:
            topic = f"workers-{uuid.uuid4().hex[:8]}"
            broker.create_topic(topic, 1)
            broker.create_topic(f"{topic}-warm-up", 1)  # the relay's KafkaSender warms up there
            server = Child("bench.transfer.kafka", "relay", db, broker.bootstrap, topic)
            stack.enter_context(server).expect("READY", STARTUP_TIMEOUT)
            consumer_args = ["consumer", broker.bootstrap, topic]
        server_cpu = proc_cpu_seconds(server.process.pid)
        consumer = stack.enter_context(
            Child(PROGRAMS[system], *consumer_args, received, 2 * limit, drain_timeout)
        )
        consumer.expect("READY", STARTUP_TIMEOUT)
        processes = [
            stack.enter_context(
                Child(PROGRAMS[system], "worker", db, i, workers, rate, per_worker, limit)
            )
            for i in range(workers)
        ]
        settings = {int(w.expect("READY", STARTUP_TIMEOUT)[0]) for w in processes}
        if settings != {NORMAL}:
            raise RuntimeError(f"workers run with PRAGMA synchronous {settings}, not NORMAL")
        start_ns = time.monotonic_ns() + int(GO_DELAY * 1e9)
        for process in processes:
            process.send(f"GO {start_ns}")
        done = [w.expect("DONE", limit + STARTUP_TIMEOUT) for w in processes]
        committed = sum(int(fields[0]) for fields in done)
        consumer.send(f"EXPECT {_count_orders(db)}")  # the workers' warm-up orders too
        *figures, receipt_ns, consumer_cpu = consumer.expect(
            "DONE", drain_timeout + STARTUP_TIMEOUT
        )
        server_cpu = proc_cpu_seconds(server.process.pid) - server_cpu  # READY to the end
    clock = {
        "last_begun": max(int(fields[6]) for fields in done),
        "last_commit": max(int(fields[2]) for fields in done),
        "last_receipt": int(receipt_ns),
    }
    seconds = {moment: (ns - start_ns) / 1e9 for moment, ns in clock.items()}
    delivered = int(figures[4])  # the timed orders received (warm-ups are not timed)
    return Run(
        system=system,
        workers=workers,
        rate=rate,
        commits_per_s=committed / seconds["last_commit"],
        delivered_per_s=delivered / seconds["last_receipt"] if delivered else 0.0,
        clock=seconds,
        committed=committed,
        refused=sum(int(fields[1]) for fields in done),
        errors=[fields[3] for fields in done if fields[3] != "-"],
        latency=[int(v) for v in figures[:5]],
        commit_latency=Latencies.merged(fields[4] for fields in done).figures(),
        cpu_seconds={
            "workers": sum(float(fields[5]) for fields in done),
            "server": server_cpu,
            "consumer": float(consumer_cpu),
        },
        check=check(db, received, first_position=1 if system == "streamq" else 0),
    )


def _count_orders(db: Path) -> int:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return int(conn.execute("SELECT COUNT(*) FROM orders").fetchone()[0])


def check(service_db: Path, received_db: Path, first_position: int) -> dict[str, Any]:
    """The consumer's receipts against the committed orders (every process stopped).

    Each committed order received once; positions (streamq seqs, Kafka offsets) dense from
    ``first_position``; order ids rising with them: the log is in commit order, as the
    ids that SQLite gives under the same write lock.
    """
    with contextlib.closing(sqlite3.connect(service_db)) as conn:
        conn.execute("ATTACH DATABASE ? AS consumer", (str(received_db),))

        def one(sql: str) -> int:
            return int(conn.execute(sql).fetchone()[0] or 0)

        tables = {row[0] for row in conn.execute("SELECT name FROM main.sqlite_master")}
        positions = [row[0] for row in conn.execute("SELECT position FROM consumer.received")]
        ids = [
            row[0] for row in conn.execute("SELECT order_id FROM consumer.received ORDER BY rowid")
        ]
        result: dict[str, Any] = {
            "committed": one("SELECT COUNT(*) FROM orders"),
            "received": len(positions),
            "logged": (
                one(HEAD_QUERY.replace("?", f"'{STREAM}'"))
                if "streamq_streams" in tables
                else one("SELECT COUNT(*) FROM outbox")
            ),
            "lost": one(
                "SELECT COUNT(*) FROM orders "
                "WHERE id NOT IN (SELECT order_id FROM consumer.received)"
            ),
            "received_twice": one(
                "SELECT COUNT(*) - COUNT(DISTINCT order_id) FROM consumer.received"
            ),
            "phantom": one(
                "SELECT COUNT(*) FROM consumer.received "
                "WHERE order_id NOT IN (SELECT id FROM orders)"
            ),
            "dense": positions == list(range(first_position, first_position + len(positions))),
            "commit_order": all(a < b for a, b in itertools.pairwise(ids)),
        }
    result["anomalies"] = (
        result["lost"]
        + result["received_twice"]
        + result["phantom"]
        + (result["logged"] != result["committed"])
        + (result["received"] != result["committed"])
        + (not result["dense"])
        + (not result["commit_order"])
    )
    return result


@dataclass(frozen=True)
class SyncRun:
    """One run of the synchronous path: orders/s, and per order its threads' CPU and the
    time they waited for a CPU (µs), with what a serving process beside it spent."""

    rate: float
    refused: int
    synchronous: int  # PRAGMA synchronous
    cpu_us: float
    waited_us: float  # runnable, waiting for a CPU
    beside_cpu_us: float = 0.0  # ``streamq serve`` and its consumer, if beside


def sync_once(
    variant: str, folder: Path, threads: int, orders: int, *, beside: bool = False
) -> SyncRun:
    """The synchronous path's ``variant`` in a fresh process; with ``beside``, while
    ``streamq serve`` runs on the database in a process of its own, pushing each commit to
    a consumer (a worker's case; not for a variant that serves itself), whose receipts
    are then checked (``check``: each order once, dense, in commit order)."""
    name = f"sync-{variant}-{threads}{'-beside' if beside else ''}"
    db, received = folder / f"{name}.db", folder / f"{name}-received.db"
    setup_database(str(db), log=True)
    with contextlib.ExitStack() as stack:
        serving: list[Child] = []
        if beside:
            server = stack.enter_context(Child("streamq", "serve", db, "--port", 0))
            address = server.expect("serving", STARTUP_TIMEOUT)[-1]
            consumer = stack.enter_context(
                Child(PROGRAMS["streamq"], "consumer", address, received, 600, DRAIN_TIMEOUT)
            )
            consumer.expect("READY", STARTUP_TIMEOUT)
            serving = [server, consumer]
        spent = [proc_cpu_seconds(child.process.pid) for child in serving]
        with Child("bench.workers.sync_path", variant, db, threads, orders, 300) as child:
            rate, committed, refused, setting, cpu, waited = child.expect("DONE", 420)
        beside_cpu = sum(proc_cpu_seconds(c.process.pid) for c in serving) - sum(spent)
        if beside:
            serving[1].send(f"EXPECT {_count_orders(db)}")
            serving[1].expect("DONE", DRAIN_TIMEOUT + STARTUP_TIMEOUT)
    if beside and (checked := check(db, received, first_position=1))["anomalies"]:
        raise RuntimeError(f"sync path {variant} beside streamq serve: {checked}")
    per_order = 1e6 / int(committed)
    return SyncRun(
        float(rate),
        int(refused),
        int(setting),
        float(cpu) * per_order,
        float(waited) * per_order,
        beside_cpu * per_order,
    )


# --- the workload -----------------------------------------------------------------


@contextlib.contextmanager
def _folder() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="streamq-workers-") as folder:
        yield Path(folder)


def _counted(count: int, noun: str) -> str:
    return f"{count} {noun}{'s' if count > 1 else ''}"


def _case(workers: int) -> str:
    return _counted(workers, "worker")


def _refused_table(runs: list[Run]) -> Table:
    table = Table(
        title="workers: refused transactions (any exception in a worker) and the consumer's "
        "receipts checked against the orders table (each once, dense, in commit order)"
    )
    for column in ("workers", "system", "runs", "committed", "refused", "anomalies"):
        table.add_column(column, justify="right" if column != "system" else "left")
    for case_workers in dict.fromkeys(r.workers for r in runs):
        for system in PROGRAMS:
            mine = [r for r in runs if r.workers == case_workers and r.system == system]
            if not mine:
                continue
            refused = sum(r.refused for r in mine)
            anomalies = sum(r.check["anomalies"] for r in mine)
            table.add_row(
                str(case_workers),
                system,
                str(len(mine)),
                f"{sum(r.committed for r in mine):,}",
                f"{'[bold red]' if refused else ''}{refused:,}",
                f"{'[bold red]' if anomalies else ''}{anomalies:,}",
            )
    return table


def _throughput_table(measured: _Measured, sizes: Sizes) -> Table:
    """delivered/s (the comparison's figure, and its ratio) beside commits/s, and how long
    the consumer trailed the last commit (medians of the runs)."""
    table = Table(
        title=f"workers: N worker processes on one database, each as fast as it can "
        f"({sizes.orders:,} orders per run; one order = INSERT + event, one transaction; "
        "kafka = outbox row + relay): delivered/s from the first commit to the consumer's "
        "last receipt, commits/s to the last COMMIT; the ratio is of delivered/s"
    )
    systems = list(dict.fromkeys(system for system, _ in measured.delivered))
    baselines = [s for s in systems if s != "streamq"]
    columns = ["workers", "system", "delivered/s", "spread", "commits/s", "trail ms", "runs"]
    for column in (*columns, *(f"streamq / {b}" for b in baselines)):
        table.add_column(column, justify="right" if column != "system" else "left")
    for workers in dict.fromkeys(w for _, w in measured.delivered):
        mine = {system: measured.delivered[(system, workers)] for system in systems}
        for system, delivered in mine.items():
            if not delivered.values:
                continue
            trails = [
                (r.clock["last_receipt"] - r.clock["last_commit"]) * 1e3
                for r in measured.runs
                if (r.system, r.workers, r.rate) == (system, workers, 0)
            ]
            ratios = [
                f"{delivered.median / mine[b].median:.2f}x"
                if system == "streamq" and mine[b].values and mine[b].median
                else ""
                for b in baselines
            ]
            table.add_row(
                str(workers),
                system,
                f"{delivered.median:,.0f}",
                f"{delivered.spread:.0%}",
                f"{measured.commits[(system, workers)].median:,.0f}",
                f"{statistics.median(trails):,.1f}",
                str(len(delivered.values)),
                *ratios,
            )
    return table


def _cpu_table(runs: list[Run]) -> Table:
    table = Table(
        title="workers: CPU per order at max rate, microseconds (median of runs): all "
        "workers, the server (streamq serve) or the relay (kafka), the consumer; the "
        "machine has 2 cores for all of them"
    )
    for column in ("workers", "system", "workers' CPU", "server / relay", "consumer"):
        table.add_column(column, justify="right" if column != "system" else "left")
    for case_workers in dict.fromkeys(r.workers for r in runs):
        for system in PROGRAMS:
            mine = [r for r in runs if (r.workers, r.system, r.rate) == (case_workers, system, 0)]
            if not mine:
                continue
            per_order = [
                f"{statistics.median(r.cpu_seconds[role] / r.committed * 1e6 for r in mine):,.0f}"
                for role in ("workers", "server", "consumer")
            ]
            table.add_row(str(case_workers), system, *per_order)
    return table


def _sync_table(series: list[Series]) -> Table:
    table = Table(
        title="synchronous path alone (one process, no server): orders/s, one transaction "
        f"each (INSERT + publish, or INSERT + outbox INSERT); goal: streamq >= {SYNC_GOAL:g} "
        "x sqlite3"
    )
    for column in ("threads", "variant", "median", "spread", "runs", "vs sqlite3"):
        table.add_column(column, justify="right" if column != "variant" else "left")
    for case in dict.fromkeys(s.case for s in series):
        mine = {s.system: s for s in series if s.case == case}
        plain = mine["sqlite3"].median
        for variant, s in mine.items():
            ratio = s.median / plain if plain else 0.0
            mark = "[bold red]" if variant != "sqlite3" and ratio < SYNC_GOAL else ""
            table.add_row(
                case,
                variant,
                f"{s.median:,.0f} orders/s",
                f"{s.spread:.0%}",
                str(len(s.values)),
                f"{mark}{ratio:.2f}x",
            )
    return table


@dataclass
class _Measured:
    """What a whole run measured: per (system, workers), per latency case, per (variant,
    threads) of the synchronous path."""

    delivered: dict[tuple[str, int], Series]
    commits: dict[tuple[str, int], Series]
    sync: dict[tuple[str, int], Series]
    latency: LatencyRuns = field(default_factory=dict)
    runs: list[Run] = field(default_factory=list)


def run(broker: Any | None, quick: bool, repeats: int, seed: int | None = None) -> dict[str, Any]:
    """Every case, side by side (the module docstring); ``seed`` is ignored (nothing here
    is drawn at random)."""
    sizes = QUICK if quick else FULL
    systems = ["streamq"] + (["kafka"] if broker is not None else [])
    console.print(
        f"[bold]workers[/] PRAGMA synchronous=NORMAL on every connection (checked); "
        f"BEGIN IMMEDIATE, busy_timeout 30 s; kafka relay producer {json.dumps(KAFKA_PRODUCER)} "
        f"polls the outbox every {RELAY_POLL * 1000:g} ms (PRAGMA data_version)"
    )
    if broker is not None:
        warm_up(broker)
    measured = _Measured(
        delivered={
            (system, w): Series(system, _case(w), "delivered/s")
            for w in sizes.workers
            for system in systems
        },
        commits={
            (system, w): Series(system, _case(w), "commits/s")
            for w in sizes.workers
            for system in systems
        },
        sync={
            (variant, threads): Series(variant, _counted(threads, "thread"), "orders/s")
            for threads in sizes.sync_threads
            for variant in SYNC_VARIANTS
        },
    )
    steps = 2 * len(sizes.workers) * len(systems) * repeats + len(measured.sync) * repeats
    with Progress(console=console, transient=True) as progress:
        task: TaskID = progress.add_task("workers", total=steps)
        _worker_runs(measured, progress, task, broker, systems, sizes, repeats)
        settings = _sync_runs(measured, progress, task, sizes, repeats)
    if settings != {NORMAL}:
        raise RuntimeError(f"the sync path ran with PRAGMA synchronous {settings}, not NORMAL")
    _report(measured, sizes)
    rate_series = [*measured.delivered.values(), *measured.commits.values()]
    latency_series = percentile_series(measured.latency)
    sync_series = list(measured.sync.values())
    paced_case = f"{sizes.rate:,}/s"
    eight = measured.latency.get(("streamq", f"{_case(max(sizes.workers))}, {paced_case}"), [])
    results = {
        "sizes": asdict(sizes),
        "synchronous": "NORMAL",
        "kafka_producer": KAFKA_PRODUCER,
        "series": [asdict(s) for s in rate_series + latency_series + sync_series],
        "runs": [asdict(r) for r in measured.runs],
        "goals": {
            "latency_p99_us_with_most_workers": statistics.median(f[1] for f in eight)
            if eight
            else None,
            "latency_goal_us": LATENCY_GOAL_US,
            "sync_ratio_goal": SYNC_GOAL,
        },
    }
    save("workers", results, quick, partial=broker is None)
    return results


def _worker_runs(
    measured: _Measured,
    progress: Progress,
    task: TaskID,
    broker: Any | None,
    systems: list[str],
    sizes: Sizes,
    repeats: int,
) -> None:
    """Per worker count, each system ``repeats`` times, alternating: as fast as the workers
    can, then paced at ``sizes.rate``."""
    paced_case = f"{sizes.rate:,}/s"
    for workers in sizes.workers:
        for system in alternating(systems, repeats):
            progress.update(task, description=f"workers: {workers}, {system}, max rate")
            with _folder() as folder:
                one = run_once(system, folder, workers, sizes.orders, 0, broker)
            measured.delivered[(system, workers)].values.append(one.delivered_per_s)
            measured.commits[(system, workers)].values.append(one.commits_per_s)
            measured.latency.setdefault((system, f"{_case(workers)}, max rate"), []).append(
                one.latency
            )
            measured.runs.append(one)
            progress.advance(task)
            progress.update(task, description=f"workers: {workers}, {system}, {paced_case}")
            count = int(sizes.rate * sizes.seconds)
            with _folder() as folder:
                one = run_once(system, folder, workers, count, sizes.rate, broker)
            measured.latency.setdefault((system, f"{_case(workers)}, {paced_case}"), []).append(
                one.latency
            )
            measured.runs.append(one)
            progress.advance(task)


def _sync_runs(
    measured: _Measured, progress: Progress, task: TaskID, sizes: Sizes, repeats: int
) -> set[int]:
    """The synchronous path alone, per thread count each variant ``repeats`` times,
    alternating. Returns the ``PRAGMA synchronous`` settings the runs had."""
    settings: set[int] = set()
    for threads in sizes.sync_threads:
        for variant in alternating(SYNC_VARIANTS, repeats):
            progress.update(task, description=f"workers: sync path, {variant}, {threads}")
            with _folder() as folder:
                one = sync_once(variant, folder, threads, sizes.sync_orders)
            if one.refused:
                raise RuntimeError(f"sync path {variant}: {one.refused} transactions refused")
            settings.add(one.synchronous)
            measured.sync[(variant, threads)].values.append(one.rate)
            progress.advance(task)
    return settings


def _report(measured: _Measured, sizes: Sizes) -> None:
    """The run's tables."""
    paced_case = f"{sizes.rate:,}/s"
    console.print(_throughput_table(measured, sizes))
    console.print(_refused_table(measured.runs))
    console.print(_cpu_table(measured.runs))
    console.print(
        latency_table(
            "workers: latency, microseconds, from each order's due time (paced) or the start "
            f"of its transaction (max rate) to its receipt by the consumer; goal: p99 <= "
            f"{LATENCY_GOAL_US:,} with 8 workers at {paced_case}",
            measured.latency,
        )
    )
    console.print(_sync_table(list(measured.sync.values())))


if __name__ == "__main__":
    raise SystemExit(workload_main("python -m bench.workers.run", __doc__, run, None))
