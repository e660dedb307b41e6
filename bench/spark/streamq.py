"""The Spark workload read from streamq producers by the ``streamq`` source: ingest from N
producers served ``PER_PROCESS`` to a process, and micro-batch latency from one producer."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from rich.progress import Progress

import streamq

from ..common import Child
from ..latency.streamq import STREAM
from .common import RECORD, Latency, measure, time_query


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


# Producers one process serves (``host.py``), as a host serving many would: a process per
# producer would measure hundreds of Python processes crowding two cores.
PER_PROCESS = 16


class Fleet:
    """The producers, ``PER_PROCESS`` to a process (``python -m bench.spark.host``)."""

    def __init__(self, paths: list[Path]) -> None:
        groups = [paths[i : i + PER_PROCESS] for i in range(0, len(paths), PER_PROCESS)]
        self.processes = [
            subprocess.Popen(
                [sys.executable, "-m", "bench.spark.host", *map(str, group)],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            for group in groups
        ]
        self.endpoints, self.producer_ids = [], []
        for process, group in zip(self.processes, groups, strict=True):
            assert process.stdout is not None
            for _ in group:
                line = process.stdout.readline()
                if not line.startswith("serving producer"):
                    raise RuntimeError(f"serving producers failed: {line!r}")
                self.endpoints.append(line.rsplit(" on ", 1)[1].strip())
                self.producer_ids.append(line.split()[2])

    def stop(self) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            process.communicate(timeout=30)


def each_fleet(counts: Sequence[int], name: str) -> Iterator[tuple[int, Fleet]]:
    """A fleet of each count in turn (ten records a producer), with a progress bar,
    stopped and removed after its turn: the driver-side tools' loop (``bench.tools``)."""
    with Progress(transient=True) as progress:
        task = progress.add_task(name, total=len(counts))
        for count in counts:
            progress.update(task, description=f"{count} producers: filling")
            with tempfile.TemporaryDirectory(prefix=f"streamq-{name}-") as folder:
                fleet = Fleet(_fill_producers(Path(folder), count, count * 10))
                try:
                    progress.update(task, description=f"{count} producers: measuring")
                    yield count, fleet
                finally:
                    fleet.stop()
            progress.advance(task)


def warm_workers(spark: Any, fleet: Fleet) -> None:
    """Two records in two tasks first, so that both of ``local[2]``'s Python workers are
    running and have imported the source: Spark stops a worker idle for a minute, and
    starting one (forking, importing pyarrow) would be charged to the timed query."""
    count = (
        spark.read.format("streamq")
        .option("endpoints", fleet.endpoints[0])
        .option("stream", "ingest")
        .option("endingOffsets", json.dumps({fleet.producer_ids[0]: 3}))
        .option("minPartitions", 2)
        .load()
        .count()
    )
    assert count == 2, count


def ingest(spark: Any, folder: Path, producers: int, total: int) -> float:
    fleet = Fleet(_fill_producers(folder, producers, total))
    try:
        warm_workers(spark, fleet)
        reader = (
            spark.readStream.format("streamq")
            .option("endpoints", ",".join(fleet.endpoints))
            .option("stream", "ingest")
            .option("startingOffsets", "earliest")
            .option("includeHeaders", "false")  # the Kafka source's columns (its default)
        )
        return time_query(spark, reader, folder / "ck")
    finally:
        fleet.stop()


def latency(spark: Any, folder: Path, rate: float, seconds: float, on_driver: bool) -> Latency:
    """The latency workload's streamq producer in its own process: never sharing the GIL
    of the driver's Python, where the foreachBatch sink runs. ``on_driver``: readOnDriver,
    the low-latency mode."""
    args = ("producer", folder / "p.db", rate, seconds, "normal")
    with Child("bench.latency.streamq", *args) as publisher:
        (address,) = publisher.expect("READY")
        reader = (
            spark.readStream.format("streamq")
            .option("endpoints", address)
            .option("stream", STREAM)
            .option("readOnDriver", str(on_driver).lower())
        )
        return measure(spark, reader, folder / "ck", publisher, rate, seconds)
