"""The Spark workload read from streamq producers by the ``streamq`` source: ingest from N
``streamq serve`` processes, and micro-batch latency from one producer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import streamq

from .common import RECORD, Sink, measure, paced, time_query


def _fill_producers(folder: Path, producers: int, total: int) -> list[Path]:
    paths = []
    for i in range(producers):
        path = folder / f"p{i}.db"
        count = total // producers
        with streamq.SyncProducer(str(path), serve=False) as producer:
            for first in range(0, count, 50_000):
                with producer.transaction() as tx:
                    tx.publish_many("ingest", [RECORD] * min(50_000, count - first))
        paths.append(path)
    return paths


class Fleet:
    """``streamq serve`` processes, one per database."""

    def __init__(self, paths: list[Path]) -> None:
        self.processes = [
            subprocess.Popen(
                [sys.executable, "-m", "streamq", "serve", str(path), "--port", "0"],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            for path in paths
        ]
        self.endpoints = []
        for process in self.processes:
            assert process.stdout is not None
            line = process.stdout.readline()
            if not line.startswith("serving producer"):
                raise RuntimeError(f"streamq serve failed: {line!r}")
            self.endpoints.append(line.rsplit(" on ", 1)[1].strip())

    def stop(self) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            process.communicate(timeout=30)


def ingest(spark: Any, folder: Path, producers: int, total: int) -> float:
    fleet = Fleet(_fill_producers(folder, producers, total))
    try:
        reader = (
            spark.readStream.format("streamq")
            .option("endpoints", ",".join(fleet.endpoints))
            .option("stream", "ingest")
            .option("startingOffsets", "earliest")
        )
        return time_query(spark, reader, folder / "ck")
    finally:
        fleet.stop()


def latency(spark: Any, folder: Path, rate: float, seconds: float) -> Sink:
    with streamq.SyncProducer(str(folder / "p.db")) as producer:
        producer.create_stream("events")

        def send(count: int) -> None:
            with producer.transaction() as tx:
                tx.publish_many("events", [RECORD] * count)

        reader = (
            spark.readStream.format("streamq")
            .option("endpoints", producer.address)
            .option("stream", "events")
            .option("startingOffsets", "latest")
        )
        return measure(spark, reader, folder / "ck", lambda: paced(rate, seconds, send))
