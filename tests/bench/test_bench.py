"""The benchmark harness cannot rot: bench-quick's pipe workload, both systems, small;
each workload runs alone (``python -m bench.<workload>.run``)."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.__main__ import WORKLOADS
from bench.kafka.broker import KafkaBroker
from bench.pipe import run as pipe

COUNT = 3000


def applied(db: Path, column: str) -> list[int]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return [row[0] for row in conn.execute(f"SELECT {column} FROM applied ORDER BY rowid")]


def test_streamq_pipe(tmp_path: Path) -> None:
    seconds = pipe.run_streamq(tmp_path, COUNT, 100)
    assert seconds > 0
    assert applied(tmp_path / "consumer.db", "seq") == list(range(1, COUNT + 1))


@pytest.mark.timeout(300)
def test_kafka_pipe(tmp_path: Path, kafka_broker: KafkaBroker) -> None:
    seconds = pipe.run_kafka(kafka_broker, tmp_path, COUNT, 100)
    assert seconds > 0
    assert applied(tmp_path / "kafka.db", "off") == list(range(COUNT))
    with contextlib.closing(sqlite3.connect(tmp_path / "kafka.db")) as conn:
        assert conn.execute("SELECT next FROM offsets").fetchall() == [(COUNT,)]


def test_each_workload_runs_alone() -> None:
    """``python -m bench.<workload>.run --help`` answers with its options: a module with
    no entry point would run nothing, silently, and exit 0."""
    with contextlib.ExitStack() as stack:  # each waited for, whatever happens
        helps = {
            name: stack.enter_context(
                subprocess.Popen(
                    [sys.executable, "-m", f"bench.{name}.run", "--help"],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
            for name in WORKLOADS
        }
        for name, process in helps.items():
            out, _ = process.communicate(timeout=120)
            assert process.returncode == 0, out
            assert out.startswith(f"usage: python -m bench.{name}.run "), out


def test_spark_fleet_serves_many_producers_to_a_process(tmp_path: Path) -> None:
    """The Spark workload's producers, ``PER_PROCESS`` to a process: each database served
    at its own endpoint, under its own id, with every record."""
    from bench.spark import streamq as spark_streamq
    from streamq import Client

    count = spark_streamq.PER_PROCESS + 3  # two processes
    paths = spark_streamq._fill_producers(tmp_path, count, count * 10)
    fleet = spark_streamq.Fleet(paths)
    try:
        assert len(fleet.processes) == 2
        assert len(set(fleet.endpoints)) == len(set(fleet.producer_ids)) == count
        for endpoint, producer_id in zip(fleet.endpoints, fleet.producer_ids, strict=True):
            with Client(endpoint) as client:
                assert client.producer_id == producer_id
                assert client.head("ingest").head == 10
    finally:
        fleet.stop()
    assert [p.returncode for p in fleet.processes] == [0, 0]


def test_spark_idle_triggers_are_measured(tmp_path: Path, spark: Any) -> None:
    """``bench.spark.idle`` on three producers: the query reads their records, then reports
    idle triggers with their phases and what its source holds, then the triggers that read
    a record more in each producer, three times."""
    from bench.spark import idle

    spark.conf.set("spark.sql.streaming.noDataProgressEventInterval", "0")
    try:
        figures = idle.streamq_idle(spark, tmp_path, 3, 1.0, idle.DATA_ROUNDS)
    finally:
        spark.conf.unset("spark.sql.streaming.noDataProgressEventInterval")
    assert figures["triggers"] >= 1
    assert 0 <= figures["latestOffset median"] <= figures["latestOffset max"]
    assert figures["latestOffset max"] <= figures["triggerExecution max"]
    assert 1 <= figures["data triggers"] <= 3 * idle.DATA_ROUNDS  # a trigger a round, or a few
    assert 0 < figures["data addBatch"] <= figures["data triggerExecution"]
    assert figures["source sockets"] == 3  # one kept connection per producer
    assert figures["source MiB"] > 0
    assert 0 <= figures["serving % core"] <= 100 * (os.cpu_count() or 1)  # the producers' process
