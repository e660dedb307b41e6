"""What an idle streaming trigger costs the Spark source's Python runner at N producers,
without Spark: ``python -m bench.tools.triggers [--producers 1024] [--triggers 50]``.

A ``StreamQStreamReader`` over producers served 16 to a process (``bench.spark.host``),
driven as PySpark's source runner drives it each trigger: the start offset decoded from
JSON, ``latestOffset``, its answer encoded, then ``reportLatestOffset`` encoded, one
trigger every ``--interval`` ms with nothing written, after a first trigger that found
every producer's records (from ``earliest``): the triggers then report that position to
each producer, and again as their watches are renewed. Prints the median and max wall time
of each step and of the trigger; docs/scaling.md has the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pyspark.sql.streaming.datasource import ReadAllAvailable
from rich.console import Console
from rich.table import Table

from spark_source.datasource import StreamQStreamReader, _Settings

from ..spark.streamq import each_fleet

STREAM = "ingest"
STEPS = ("decode start", "latestOffset", "encode end", "reportLatestOffset", "trigger")


class _Steps:
    """Wall times of a trigger's steps, in ms: ``lap(step)`` ends the step under way."""

    def __init__(self) -> None:
        self.walls: dict[str, list[float]] = {step: [] for step in STEPS}
        self.began = self.lap_began = 0.0

    def start(self) -> None:
        self.began = self.lap_began = time.perf_counter()

    def lap(self, step: str) -> None:
        now = time.perf_counter()
        self.walls[step].append((now - self.lap_began) * 1000)
        self.lap_began = now
        if step == STEPS[-2]:
            self.walls[STEPS[-1]].append((now - self.began) * 1000)


def measure(endpoints: list[str], triggers: int, interval: float) -> dict[str, list[float]]:
    """``triggers`` idle triggers of one reader, after the first one that connects."""
    options = {"endpoints": ",".join(endpoints), "stream": STREAM, "startingOffsets": "earliest"}
    reader = StreamQStreamReader(_Settings(options))
    steps = _Steps()
    try:
        text = json.dumps(reader.latestOffset(reader.initialOffset(), ReadAllAvailable()))
        for _ in range(triggers):
            time.sleep(interval)
            steps.start()
            start = json.loads(text)
            steps.lap("decode start")
            end = reader.latestOffset(start, ReadAllAvailable())
            steps.lap("latestOffset")
            text = json.dumps(end)
            steps.lap("encode end")
            json.dumps(reader.reportLatestOffset())
            steps.lap("reportLatestOffset")
        return steps.walls
    finally:
        reader.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tools.triggers")
    parser.add_argument("--producers", default="1024", help="comma-separated counts")
    parser.add_argument("--triggers", type=int, default=50, help="idle triggers per count")
    parser.add_argument("--interval", type=float, default=200, help="ms between triggers")
    args = parser.parse_args(argv)
    counts = [int(count) for count in args.producers.split(",")]
    table = Table(title="an idle trigger in the source's Python runner, ms (median / max)")
    table.add_column("producers", justify="right")
    for step in STEPS:
        table.add_column(step, justify="right")
    for count, fleet in each_fleet(counts, "triggers"):
        walls = measure(fleet.endpoints, args.triggers, args.interval / 1000)
        cells = (f"{statistics.median(w):.1f} / {max(w):.1f}" for w in walls.values())
        table.add_row(str(count), *cells)
    Console().print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
