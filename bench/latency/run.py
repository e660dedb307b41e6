"""The latency workload's driver: p50, p99, p99.9 and max per rate and system, measured
from the schedule (the package's docstring). Both sides are configured for latency."""

from __future__ import annotations

import tempfile
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.progress import Progress
from rich.table import Table

from ..common import (
    PERCENTILES,
    Child,
    LatencyRuns,
    alternating,
    console,
    durability_modes,
    percentile_series,
    save,
)

RATES = [1_000, 10_000, 50_000]


def _measure(producer: Child, consumer: Child) -> list[int]:
    consumer.expect("READY")
    producer.send("GO")
    producer.expect("START")
    done = consumer.expect("DONE", timeout=600)
    producer.send("STOP")
    return [int(v) for v in done[:4]]


def run_streamq(folder: Path, rate: int, seconds: float, mode: str = "normal") -> list[int]:
    total = int(rate * seconds)
    programs = "bench.latency.streamq"
    with Child(programs, "producer", folder / "p.db", rate, seconds, mode) as producer:
        (address,) = producer.expect("READY")
        with Child(programs, "consumer", address, total) as consumer:
            return _measure(producer, consumer)


def run_kafka(broker: Any, rate: int, seconds: float) -> list[int]:
    total = int(rate * seconds)
    topic = f"latency-{uuid.uuid4().hex[:8]}"
    broker.create_topic(topic, 1)
    programs, bootstrap = "bench.latency.kafka", broker.bootstrap
    with Child(programs, "producer", bootstrap, topic, rate, seconds) as producer:
        producer.expect("READY")
        with Child(programs, "consumer", bootstrap, topic, total) as consumer:
            return _measure(producer, consumer)


def run(broker: Any | None, quick: bool, repeats: int) -> dict[str, Any]:
    seconds = 2.0 if quick else 10.0
    systems = ["streamq"] + (["kafka"] if broker is not None else [])
    # (system, case) -> one list of [p50, p99, p99.9, max] per repeat, in microseconds
    runs: LatencyRuns = {}
    cases: list[str] = []
    with durability_modes(broker) as modes, Progress(console=console, transient=True) as progress:
        task = progress.add_task("latency", total=len(modes) * len(RATES) * repeats * len(systems))
        for mode, mode_broker in modes:
            for rate in RATES:
                case = f"{rate:,}/s {mode}"
                cases.append(case)
                for system in alternating(systems, repeats):
                    if system == "streamq":
                        with tempfile.TemporaryDirectory() as folder:
                            figures = run_streamq(Path(folder), rate, seconds, mode)
                    else:
                        figures = run_kafka(mode_broker, rate, seconds)
                    runs.setdefault((system, case), []).append(figures)
                    progress.advance(task)

    def median(system: str, case: str, i: int) -> int:
        values = sorted(r[i] for r in runs[(system, case)])
        return values[len(values) // 2]

    table = Table(title=f"latency, publish -> receipt, microseconds ({seconds:g} s per run)")
    for column in ("rate, durability", "system", *PERCENTILES, "p99 vs kafka"):
        table.add_column(column, justify="right")
    for case in cases:
        for system in systems:
            medians = [median(system, case, i) for i in range(4)]
            ratio = ""
            if system == "streamq" and ("kafka", case) in runs and median("kafka", case, 1):
                ratio = f"{medians[1] / median('kafka', case, 1):.2f}x"
            table.add_row(case, system, *(f"{m:,}" for m in medians), ratio)
    console.print(table)
    series = percentile_series(runs)
    results = {
        "seconds_per_run": seconds,
        "series": [asdict(s) for s in series],
    }
    save("latency", results, quick)
    return results
