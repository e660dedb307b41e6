"""Workload 2, latency: fixed publish rates; from each record's due time to its receipt.

p50, p99, p99.9 and max per rate and system, measured from the schedule (no coordinated
omission: see ``latency_programs``). Both sides are configured for latency.
"""

from __future__ import annotations

import tempfile
import uuid
from pathlib import Path
from typing import Any

from rich.progress import Progress
from rich.table import Table

from .common import DURABILITY, Child, Series, bar_chart, console, results_dir, save

RATES = [1_000, 10_000, 50_000]
PERCENTILES = ("p50", "p99", "p99.9", "max")


def _measure(producer: Child, consumer: Child) -> list[int]:
    consumer.expect("READY")
    producer.send("GO")
    producer.expect("START")
    done = consumer.expect("DONE", timeout=600)
    producer.send("STOP")
    return [int(v) for v in done[:4]]


def run_streamq(folder: Path, rate: int, seconds: float) -> list[int]:
    total = int(rate * seconds)
    with Child("bench.latency_programs", "sq-producer", folder / "p.db", rate, seconds) as producer:
        (address,) = producer.expect("READY")
        with Child("bench.latency_programs", "sq-consumer", address, total) as consumer:
            return _measure(producer, consumer)


def run_kafka(broker: Any, rate: int, seconds: float) -> list[int]:
    total = int(rate * seconds)
    topic = f"latency-{uuid.uuid4().hex[:8]}"
    broker.create_topic(topic, 1)
    programs, bootstrap = "bench.latency_programs", broker.bootstrap
    with Child(programs, "kafka-producer", bootstrap, topic, rate, seconds) as producer:
        producer.expect("READY")
        with Child(programs, "kafka-consumer", bootstrap, topic, total) as consumer:
            return _measure(producer, consumer)


def run(broker: Any | None, quick: bool, repeats: int) -> dict[str, Any]:
    seconds = 2.0 if quick else 10.0
    systems = ["streamq"] + (["kafka"] if broker is not None else [])
    # (system, rate) -> one list of [p50, p99, p99.9, max] per repeat, in microseconds
    runs: dict[tuple[str, int], list[list[int]]] = {}
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("latency", total=len(RATES) * repeats * len(systems))
        for rate in RATES:
            for repeat in range(repeats):
                for system in systems if repeat % 2 == 0 else systems[::-1]:
                    if system == "streamq":
                        with tempfile.TemporaryDirectory() as folder:
                            figures = run_streamq(Path(folder), rate, seconds)
                    else:
                        figures = run_kafka(broker, rate, seconds)
                    runs.setdefault((system, rate), []).append(figures)
                    progress.advance(task)
    series = [
        Series(system, f"{rate:,}/s {name}", "us", [r[i] for r in figures])
        for (system, rate), figures in runs.items()
        for i, name in enumerate(PERCENTILES)
    ]
    table = Table(title=f"latency, publish -> receipt, microseconds ({seconds:g} s per run)")
    for column in ("rate", "system", *PERCENTILES, "p99 vs kafka"):
        table.add_column(column, justify="right")
    for rate in RATES:
        for system in systems:
            medians = [
                sorted(r[i] for r in runs[(system, rate)])[len(runs[(system, rate)]) // 2]
                for i in range(4)
            ]
            ratio = ""
            if system == "streamq" and (("kafka", rate) in runs):
                kafka_p99 = sorted(r[1] for r in runs[("kafka", rate)])[
                    len(runs[("kafka", rate)]) // 2
                ]
                ratio = f"{medians[1] / kafka_p99:.2f}x" if kafka_p99 else ""
            table.add_row(f"{rate:,}/s", system, *(f"{m:,}" for m in medians), ratio)
    console.print(table)
    bar_chart(
        results_dir(quick) / "latency.png",
        "latency p99 (microseconds, lower is better)",
        [s for s in series if s.case.endswith(" p99")],
        "microseconds",
    )
    results = {
        "durability": DURABILITY,
        "seconds_per_run": seconds,
        "series": [
            {"system": s.system, "case": s.case, "unit": s.unit, "values": s.values} for s in series
        ],
    }
    save("latency", results, quick)
    return results
