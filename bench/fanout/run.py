"""The fan-out workload's driver (the package's docstring).

``python -m bench.fanout.run [--quick] [--repeats N] [--consumers 1,10,100] [--rates 1000]``.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path
from typing import Any

from rich.progress import Progress
from rich.table import Table

from ..common import Child, console, save
from ..measure import Latencies

CONSUMERS = [1, 10, 100, 300, 1_000]
RATES = [1_000, 10_000]
PER_PROCESS = 250  # consumers in one process at most


def run_streamq(folder: Path, consumers: int, rate: int, seconds: float) -> dict[str, Any]:
    total = int(rate * seconds)
    programs = "bench.fanout.streamq"
    counts = _split(consumers)
    with Child(programs, "producer", folder / "p.db", rate, seconds) as producer:
        (address,) = producer.expect("READY")
        children = [Child(programs, "consumers", address, n, total) for n in counts]
        try:
            for child in children:
                child.expect("READY", timeout=300)
            producer.send("GO")
            producer.expect("START")
            published = producer.expect("PUBLISHED", timeout=seconds * 20 + 60)
            done = [child.expect("DONE", timeout=600) for child in children]
        finally:
            for child in children:
                child.stop()
        producer.send("STOP")
    reached, cpu, commits, publish_p50, publish_p99 = map(float, published)
    received = sum(int(d[0]) for d in done)
    p50, p99, *_ = Latencies.merged(d[1] for d in done).figures()
    return {
        "consumers": consumers,
        "rate": rate,
        "reached": reached,
        "cpu_per_commit_us": cpu / commits * 1e6,
        "publish_p50_us": publish_p50,
        "publish_p99_us": publish_p99,
        "p50_us": p50,
        "p99_us": p99,
        "delivered": received,
        "expected": total * consumers,
    }


def _split(consumers: int) -> list[int]:
    processes = max(1, math.ceil(consumers / PER_PROCESS))
    return [consumers // processes + (i < consumers % processes) for i in range(processes)]


def run(quick: bool, repeats: int, consumers: list[int], rates: list[int]) -> list[dict[str, Any]]:
    seconds = 2.0 if quick else 10.0
    results: list[dict[str, Any]] = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("fanout", total=len(consumers) * len(rates) * repeats)
        for rate in rates:
            for n in consumers:
                for _ in range(repeats):
                    with tempfile.TemporaryDirectory() as folder:
                        results.append(run_streamq(Path(folder), n, rate, seconds))
                    progress.advance(task)
    table = Table(title=f"fan-out: one producer, N consumers ({seconds:g} s per run)")
    for column in (
        "rate/s",
        "consumers",
        "reached/s",
        "CPU µs/commit",
        "publish p50 µs",
        "publish p99 µs",
        "p50 µs",
        "p99 µs",
        "delivered",
    ):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(
            f"{r['rate']:,}",
            f"{r['consumers']:,}",
            f"{r['reached']:,.0f}",
            f"{r['cpu_per_commit_us']:,.1f}",
            f"{r['publish_p50_us']:,.0f}",
            f"{r['publish_p99_us']:,.0f}",
            f"{r['p50_us']:,}",
            f"{r['p99_us']:,}",
            f"{r['delivered']:,}/{r['expected']:,}",
        )
    console.print(table)
    save("fanout", {"seconds_per_run": seconds, "runs": results}, quick, partial=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fanout.run", description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--consumers", default=",".join(map(str, CONSUMERS)))
    parser.add_argument("--rates", default=",".join(map(str, RATES)))
    args = parser.parse_args(argv)
    run(
        args.quick,
        args.repeats or (1 if args.quick else 3),
        [int(n) for n in args.consumers.split(",")],
        [int(n) for n in args.rates.split(",")],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
