"""What an idle trigger costs a streaming query at N producers (N Kafka partitions beside
it): ``python -m bench.spark.idle [--producers 64,256] [--seconds 130] [--repeats 1]
[--data-rounds 3] [--no-kafka]``.

A query over a few records per producer (partition) into a noop sink, triggered every
200 ms; once it has read them, every trigger finds nothing new. Spark reports such a
trigger only every 10 s by default (``noDataProgressEventInterval``), so that is set to 0
here. Prints the median and max of the idle triggers' ``latestOffset`` and
``triggerExecution`` (Spark's ``durationMs``), over ``--seconds`` after the read: by
default past ``planning.WATCH_TRUST``, so that every producer's watch has been renewed
once and the positions told again, as they are all along a query that idles. Then,
``--data-rounds`` times, one new record in every producer (partition) while the query
runs: the median ``addBatch`` and ``triggerExecution`` of the triggers that read them
(``data``). And what the source holds once idle (``footprint``): the streamq source's
Python process's memory and its connections to the producers; the Kafka source's JVM's
(all of Spark's) and its connections to the broker. And what serving the idle query
costs over those ``--seconds`` (``serving % core``): the producers' processes' CPU
(16 producers to a process), the broker's. With ``--repeats N`` each count runs
both sources N times, alternating which goes first, and the table gives each figure's
median over the runs. docs/scaling.md has the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sqlite3
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

import streamq
from spark_source import planning

from ..common import alternating, proc_cpu_seconds, wait_until
from . import footprint, kafka
from .common import RECORD, noop_query
from .kafka import _fill_topic, _produce
from .run import spark_session
from .streamq import Fleet, _fill_producers

PER_SOURCE = 4  # records per producer (partition)
DATA_ROUNDS = 3  # rounds of one new record per producer (partition), by default
# One source's run: (spark, folder, producers, seconds, data rounds) -> figures.
Case = Callable[[Any, Path, int, float, int], dict[str, float]]
TRIGGER = "200 milliseconds"
WAIT = 300.0  # s, the bound on each wait for the query


PHASES = ("latestOffset", "triggerExecution", "addBatch")


class _Progress:
    """A query's progress reports, gathered from ``recentProgress`` as they come: Spark
    keeps only the last 100 (20 s of triggers here) and posts no event for an idle one.
    Read from Spark's JVM a field at a time: PySpark's ``recentProgress`` parses every
    report whole at each call, at 1,024 producers two offsets of about 90 KB each, most
    of a core taken from the query measured when polled often enough to miss none."""

    POLL = 1.0

    def __init__(self, query: Any) -> None:
        self._query = query._jsq
        self._seen: dict[str, dict[str, Any]] = {}  # by timestamp: idle ones share a batchId

    def since(self, began: str) -> list[dict[str, Any]]:
        """Those of triggers that began after ``began`` (a report's timestamp), in order."""
        for report in self._query.recentProgress():
            timestamp = report.timestamp()
            if timestamp not in self._seen:
                durations = report.durationMs()
                self._seen[timestamp] = {
                    "timestamp": timestamp,
                    "numInputRows": report.numInputRows(),
                    "durationMs": {p: v for p in PHASES if (v := durations.get(p)) is not None},
                }
        return [self._seen[t] for t in sorted(self._seen) if t > began]

    def read(self, rows: int, began: str) -> list[dict[str, Any]]:
        """Wait until the query has read ``rows`` in triggers after ``began``; the reports
        of those that read any."""

        def batches() -> list[dict[str, Any]] | None:
            found = [p for p in self.since(began) if p["numInputRows"]]
            return found if sum(p["numInputRows"] for p in found) >= rows else None

        return wait_until(f"{rows} rows read", batches, WAIT, self.POLL)

    def idle(self) -> str:
        """Wait for a trigger that found nothing new; its timestamp."""

        def idle() -> str | None:
            last = self._query.lastProgress()
            found = last is not None and not last.numInputRows()
            return last.timestamp() if found else None

        return wait_until("idle trigger", idle, WAIT, 0.2)


def idle_triggers(
    reader: Any,
    checkpoint: Path,
    rows: int,
    seconds: float,
    rounds: int,
    add: Callable[[], int],
    holds: Callable[[], dict[str, float]],
    serving: Callable[[], float],
) -> dict[str, float]:
    """Median and max ``latestOffset`` and ``triggerExecution`` (ms) of the idle triggers
    in ``seconds`` after the query read its ``rows``, what the source ``holds`` at their
    end, and the share of a core the serving side used meanwhile (``serving``: its CPU
    seconds so far); then the median ``addBatch`` and ``triggerExecution`` of the
    triggers that read what ``add`` adds (it returns how many rows), ``rounds`` times."""
    query = noop_query(reader, checkpoint, processingTime=TRIGGER)
    try:
        progress = _Progress(query)
        read = progress.read(rows, "")
        idled, used = time.monotonic(), serving()
        until = idled + seconds

        def enough() -> list[dict[str, Any]] | None:
            """At least ``seconds`` of triggers, and at least one idle trigger."""
            later = progress.since(read[-1]["timestamp"])
            idle = [p for p in later if not p["numInputRows"]]
            return idle if idle and time.monotonic() >= until else None

        idle = wait_until("idle trigger", enough, seconds + WAIT, progress.POLL)
        share = (serving() - used) / (time.monotonic() - idled) * 100
        held = {**holds(), "serving % core": share}
        data = []
        for _ in range(rounds):
            began = progress.idle()  # before adding: its rows may come at once
            data += progress.read(add(), began)
    finally:
        query.stop()
    figures = {}
    for phase in ("latestOffset", "triggerExecution"):
        values = [p["durationMs"].get(phase, 0) for p in idle]
        figures[f"{phase} median"] = statistics.median(values)
        figures[f"{phase} max"] = max(values)
    figures["triggers"] = len(idle)
    for phase in ("addBatch", "triggerExecution"):
        figures[f"data {phase}"] = statistics.median(p["durationMs"][phase] for p in data)
    figures["data triggers"] = len(data)
    return {**figures, **held}


def streamq_idle(
    spark: Any, folder: Path, producers: int, seconds: float, rounds: int
) -> dict[str, float]:
    paths = _fill_producers(folder, producers, producers * PER_SOURCE)
    fleet = Fleet(paths)
    try:
        reader = (
            spark.readStream.format("streamq")
            .option("endpoints", ",".join(fleet.endpoints))
            .option("stream", "ingest")
            .option("startingOffsets", "earliest")
        )
        return idle_triggers(
            reader,
            folder / "ck",
            producers * PER_SOURCE,
            seconds,
            rounds,
            lambda: _publish(paths),
            lambda: footprint.streamq_source(fleet.endpoints),
            lambda: sum(proc_cpu_seconds(process.pid) for process in fleet.processes),
        )
    finally:
        fleet.stop()


def _publish(paths: list[Path]) -> int:
    """One record in each producer's database, as a worker process of each would write it
    (``streamq.publish`` on its own connection): the producers serving them find it."""
    for path in paths:
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
            conn.execute("BEGIN IMMEDIATE")
            streamq.publish(conn, "ingest", RECORD)
            conn.execute("COMMIT")
    return len(paths)


def kafka_idle(
    spark: Any, folder: Path, partitions: int, seconds: float, rounds: int, *, broker: Any
) -> dict[str, float]:
    topic = f"idle-{uuid.uuid4().hex[:8]}"
    _fill_topic(broker, topic, partitions, partitions * PER_SOURCE)
    read = kafka.reader(spark, broker, topic, startingOffsets="earliest")

    def add() -> int:
        _produce(broker, topic, partitions, partitions)
        return partitions

    held = functools.partial(footprint.kafka_source, broker.bootstrap)
    serving = functools.partial(proc_cpu_seconds, broker.pid)
    rows = partitions * PER_SOURCE
    return idle_triggers(read, folder / "ck", rows, seconds, rounds, add, held, serving)


@contextlib.contextmanager
def _broker(with_kafka: bool) -> Iterator[Any]:
    if not with_kafka:
        yield None
        return
    from ..kafka.broker import KafkaBroker

    with KafkaBroker() as broker:
        yield broker


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.spark.idle")
    parser.add_argument("--producers", default="64,256", help="comma-separated counts")
    parser.add_argument(
        "--seconds",
        type=float,
        default=planning.WATCH_TRUST,
        help=f"of idle triggers per case ({planning.WATCH_TRUST:g}: past every watch's renewal)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs per source and count (1)")
    parser.add_argument(
        "--data-rounds", type=int, default=DATA_ROUNDS, help=f"data rounds per run ({DATA_ROUNDS})"
    )
    parser.add_argument("--no-kafka", action="store_true", help="streamq alone (no broker)")
    args = parser.parse_args(argv)
    counts = [int(count) for count in args.producers.split(",")]
    title = f"idle triggers ({TRIGGER}), ms; medians of {args.repeats} run(s)"
    table = Table(title=title)
    columns = ("source", "producers", "latestOffset", "max", "triggerExecution", "max")
    data = ("data addBatch", "data trigger", "data triggers")
    for column in (*columns, "triggers", *data, "source MiB", "sockets", "serving % core"):
        table.add_column(column, justify="right")
    with _broker(not args.no_kafka) as broker:
        spark = spark_session(broker is not None)
        spark.conf.set("spark.sql.streaming.noDataProgressEventInterval", "0")
        for count in counts:
            cases: dict[str, Case] = {"streamq": streamq_idle}
            if broker is not None:
                cases["kafka"] = functools.partial(kafka_idle, broker=broker)
            runs: dict[str, list[dict[str, float]]] = {source: [] for source in cases}
            for source in alternating(list(cases), args.repeats):
                with tempfile.TemporaryDirectory(prefix="streamq-idle-") as folder:
                    figures = cases[source](
                        spark, Path(folder), count, args.seconds, args.data_rounds
                    )
                print(source, count, json.dumps(figures), flush=True)  # each run, as it ends
                runs[source].append(figures)
            for source, each in runs.items():
                medians = [statistics.median(run[name] for run in each) for name in each[0]]
                table.add_row(
                    source, str(count), *(f"{v:,.1f}" if v < 10 else f"{v:,.0f}" for v in medians)
                )
        spark.stop()
    Console(width=200).print(table)  # every column whole, on any terminal
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
