"""The Spark sink workload's fault: a streaming query's driver killed with kill -9 (the
Python driver, its JVM and its Python workers at once) in micro-batch ``KILLED_BATCH``,
then restarted from its checkpoint; then the rows the consumer applied more than once.

- streamq: killed once the sink's transaction for the batch has committed, before Spark's
  commit log records the batch (the sink's tests' hook, ``tests/spark/programs/sink_hooks``,
  pauses the commit there): Spark runs the batch again on restart;
- Kafka: killed as soon as the batch's first rows are in the topic (the broker's end
  offsets polled), while its tasks write: the batch is not committed, Spark runs it again.

The query (``python -m bench.spark_sink.faults SYSTEM CHECKPOINT OPTIONS``, a process of
its own, local[2]) writes ``FAULT_ROWS`` rows from ``rate-micro-batch``, ``FAULT_BATCH``
a micro-batch in ``FAULT_PARTITIONS`` partitions, and stops once they are written.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..common import wait_until
from .consumers import rows_from
from .targets import start_query, target

FAULT_ROWS = 100_000
FAULT_BATCH = 20_000
FAULT_PARTITIONS = 4
KILLED_BATCH = 2
FAULTS = {
    "rows": FAULT_ROWS,
    "batch_rows": FAULT_BATCH,
    "partitions": FAULT_PARTITIONS,
    "killed_batch": KILLED_BATCH,
}
RUN_TIMEOUT = 300.0  # s: a query's JVM start and its micro-batches, on a loaded machine
PAUSE_AFTER_COMMIT = "STREAMQ_SINK_PAUSE_AFTER_COMMIT"  # tests/spark/programs/sink_hooks.py


@dataclass
class Fault:
    """One sink's fault run, as its consumer's database tells it."""

    system: str
    in_sink: int  # rows of the killed batch in the sink's system at the kill
    spark_committed: bool  # the killed batch in Spark's commit log at the kill
    rows: int  # rows the query writes
    applied: int  # rows the consumer applied
    distinct: int
    duplicates: int  # applied more than once
    missing: int


@contextlib.contextmanager
def _env(name: str, value: str | None) -> Iterator[None]:
    """``name`` set (or not) in this process's environment meanwhile: the query's process
    and its Python workers inherit it."""
    before = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)
        if before is not None:
            os.environ[name] = before


def _kafka_written(bootstrap: str, topic: str) -> Any:
    """A function returning how many records the topic holds (its end offsets' sum)."""
    from confluent_kafka import Consumer, TopicPartition

    probe = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench-probe"})
    partitions = probe.list_topics(topic, timeout=30).topics[topic].partitions

    def written() -> int:
        return sum(
            probe.get_watermark_offsets(TopicPartition(topic, p), timeout=10, cached=False)[1]
            for p in partitions
        )

    return written


def _streamq_written(db: str) -> int:
    """Records the sink published: the sum of its markers' counts."""
    with contextlib.closing(sqlite3.connect(db, timeout=30)) as conn:
        (total,) = conn.execute(
            "SELECT coalesce(sum(records), 0) FROM spark_streamq_batches"
        ).fetchone()
    return int(total)


def fault_run(system: str, broker: Any, folder: Path) -> Fault:
    """The fault for ``system``'s sink, into a fresh target and consumer."""
    # The sink tests' process handling: a program in a session of its own, killed whole.
    from tests.spark.test_spark_exactly_once import Proc, adopting_orphans

    checkpoint = folder / f"ck-fault-{system}"
    flag = folder / f"committed-{system}"
    with target(system, broker, folder, FAULT_PARTITIONS) as where, adopting_orphans():
        args = ["-m", "bench.spark_sink.faults", system, str(checkpoint), json.dumps(where.options)]
        if system == "streamq":
            written: Any = lambda: _streamq_written(where.options["db"])  # noqa: E731
            pause = f"{KILLED_BATCH}:{flag}"
        else:
            written = _kafka_written(broker.bootstrap, where.options["topic"])
            pause = None
        with _env(PAUSE_AFTER_COMMIT, pause):
            first = Proc(args, folder / f"first-{system}.log")
        if system == "streamq":  # the sink's transaction committed, Spark's commit log waits
            reached: Any = flag.exists
        else:  # the batch's first rows are in the topic
            reached = lambda: written() > KILLED_BATCH * FAULT_BATCH  # noqa: E731
        try:
            what = f"{system}'s batch {KILLED_BATCH} written"
            wait_until(what, lambda: reached() or not first.alive(), RUN_TIMEOUT, every=0.002)
        finally:
            status = first.kill_all()
        if status != -signal.SIGKILL:
            raise RuntimeError(f"the query ended ({status}) before the kill:\n{first.tail()}")
        committed = (checkpoint / "commits" / str(KILLED_BATCH)).exists()
        in_sink = written() - KILLED_BATCH * FAULT_BATCH
        second = Proc(args, folder / f"second-{system}.log")
        if second.wait(RUN_TIMEOUT) != 0:
            second.kill_all()
            raise RuntimeError(f"the restarted query failed:\n{second.tail()}")
        total = written()
        wait_until(
            f"{total} rows applied through {system}",
            lambda: where.rows() >= total,
            RUN_TIMEOUT,
            every=0.05,
        )
        count, distinct = where.applied()
    return Fault(
        system, in_sink, committed, FAULT_ROWS, count, distinct, count - distinct,
        FAULT_ROWS - distinct,
    )  # fmt: skip


def query(system: str, checkpoint: str, options: dict[str, str]) -> None:
    """The query's process: ``FAULT_ROWS`` rows through ``system``'s sink, then stop."""
    from ..spark.run import spark_session

    spark = spark_session(with_kafka=system == "kafka")
    if system == "streamq":
        from tests.spark.programs.sink_hooks import PausingSource

        spark.dataSource.register(PausingSource)  # format("streamq"), pausing after a commit
    source = rows_from(
        spark,
        "rate-micro-batch",
        FAULT_ROWS,
        rowsPerBatch=FAULT_BATCH,
        numPartitions=FAULT_PARTITIONS,
    )
    running = start_query(source, options, Path(checkpoint))
    print("started", flush=True)
    last = FAULT_ROWS // FAULT_BATCH - 1  # the last micro-batch with rows

    def finished() -> bool:
        if running.exception() is not None:
            raise RuntimeError(str(running.exception()))
        progress = running.lastProgress
        return progress is not None and progress["batchId"] >= last

    wait_until("the query's last micro-batch", finished, RUN_TIMEOUT, every=0.05)
    running.stop()
    print("done", flush=True)
    spark.stop()


if __name__ == "__main__":
    query(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
