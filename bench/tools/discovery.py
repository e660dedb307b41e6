"""What a streaming trigger's discovery costs the Spark driver at N producers:
``python -m bench.tools.discovery [--producers 64,256,1024] [--rounds 20]``.

``planning.discover`` over producers served 16 to a process (``bench.spark.host``), on
the connections the source keeps between triggers, as ``latestOffset`` runs it: an idle
round (the query's position at every head, every kept connection watching its head with
no answer: nobody is asked) and a round as if every producer had new records (the
position behind every head, and no watch believed: every producer asked, two rounds).
Prints the median and max wall time, and the driver's CPU per round. docs/scaling.md has
the figures.
"""

from __future__ import annotations

import argparse
import statistics
import time

from rich.console import Console
from rich.table import Table

from spark_source import planning

from ..spark.streamq import Fleet, each_fleet

STREAM = "ingest"


def measure(fleet: Fleet, rounds: int) -> dict[str, float]:
    """Idle and behind rounds of discovery over ``fleet``, after a first one that connects."""
    connections = planning.Connections(planning.Connect())
    try:
        states = planning.discover(fleet.endpoints, STREAM, connections, {})
        figures: dict[str, float] = {}
        trusted = planning.WATCH_TRUST
        for case, back, trust in (("idle", 0, trusted), ("behind", 5, 0.0)):
            positions = {
                pid: planning.Position(s.head + 1 - back, s.epoch) for pid, s in states.items()
            }
            walls, cpu = [], time.process_time()
            planning.WATCH_TRUST = trust
            try:
                for _ in range(rounds):
                    start = time.perf_counter()
                    found = planning.discover(fleet.endpoints, STREAM, connections, positions)
                    walls.append((time.perf_counter() - start) * 1000)
                    moved = [p for p, s in found.items() if s.lost or s.epoch != states[p].epoch]
                    if moved:
                        raise RuntimeError(f"lost seqs or a new epoch in a still fleet: {moved}")
            finally:
                planning.WATCH_TRUST = trusted
            figures[f"{case} median"] = statistics.median(walls)
            figures[f"{case} max"] = max(walls)
            figures[f"{case} cpu"] = (time.process_time() - cpu) / rounds * 1000
        return figures
    finally:
        connections.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tools.discovery")
    parser.add_argument("--producers", default="64,256,1024", help="comma-separated counts")
    parser.add_argument("--rounds", type=int, default=20, help="rounds per case")
    args = parser.parse_args(argv)
    counts = [int(count) for count in args.producers.split(",")]
    table = Table(title="discovery per trigger, ms (driver CPU: ms per round)")
    for column in ("producers", "idle median", "idle max", "idle cpu", "behind median"):
        table.add_column(column, justify="right")
    table.add_column("behind max", justify="right")
    table.add_column("behind cpu", justify="right")
    for count, fleet in each_fleet(counts, "discovery"):
        figures = measure(fleet, args.rounds)
        table.add_row(str(count), *(f"{value:.1f}" for value in figures.values()))
    Console().print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
