"""The slow-consumer workload's driver (the package's docstring).

Reports the producer's commit rate (overall and its worst second) and peak memory of the
producer, the consumer and (for Kafka) the broker. streamq holds a slow consumer back
with TCP alone; the producer should neither slow down nor grow.
"""

from __future__ import annotations

import tempfile
import uuid
from pathlib import Path
from typing import Any

from rich.progress import Progress
from rich.table import Table

from ..common import Child, alternating, console, proc_kib, save, workload_main

FULL = (20_000, 60.0)
QUICK = (5_000, 5.0)


def _run(
    producer: Child, consumer: Child, broker_pid: int | None, seconds: float
) -> dict[str, Any]:
    consumer.expect("READY")
    before = {
        "producer": proc_kib(producer.process.pid, "VmRSS"),
        "broker": proc_kib(broker_pid, "VmRSS") if broker_pid else 0,
    }
    producer.send("GO")
    achieved, worst = (float(v) for v in producer.expect("DONE", timeout=seconds + 300))
    producer_peak = proc_kib(producer.process.pid, "VmHWM")
    figures = {
        "commit_rate": achieved,
        "worst_second": worst,
        "producer_growth_mib": (producer_peak - before["producer"]) / 1024,
        "producer_peak_mib": producer_peak / 1024,
        "consumer_peak_mib": proc_kib(consumer.process.pid, "VmHWM") / 1024,
    }
    if broker_pid:
        figures["broker_growth_mib"] = (proc_kib(broker_pid, "VmRSS") - before["broker"]) / 1024
    producer.send("STOP")
    return figures


def run_streamq(folder: Path, rate: int, seconds: float) -> dict[str, Any]:
    programs = "bench.slow.streamq"
    with Child(programs, "producer", folder / "p.db", rate, seconds) as producer:
        (address,) = producer.expect("READY")
        with Child(programs, "consumer", address, folder / "c.db", rate / 10) as consumer:
            return _run(producer, consumer, None, seconds)


def run_kafka(broker: Any, folder: Path, rate: int, seconds: float) -> dict[str, Any]:
    topic = f"slow-{uuid.uuid4().hex[:8]}"
    broker.create_topic(topic, 1)
    programs, bootstrap = "bench.slow.kafka", broker.bootstrap
    with Child(programs, "producer", bootstrap, topic, rate, seconds) as producer:
        producer.expect("READY")
        db = folder / "k.db"
        with Child(programs, "consumer", bootstrap, topic, db, rate / 10) as consumer:
            return _run(producer, consumer, broker.pid, seconds)


def run(broker: Any | None, quick: bool, repeats: int, seed: int | None = None) -> dict[str, Any]:
    """Each system ``repeats`` times, alternating; ``seed`` is ignored (nothing here is
    drawn at random)."""
    rate, seconds = QUICK if quick else FULL
    systems = ["streamq"] + (["kafka"] if broker is not None else [])
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("slow consumer", total=repeats * len(systems))
        for system in alternating(systems, repeats):
            with tempfile.TemporaryDirectory() as folder:
                if system == "streamq":
                    runs[system].append(run_streamq(Path(folder), rate, seconds))
                else:
                    runs[system].append(run_kafka(broker, Path(folder), rate, seconds))
            progress.advance(task)
    table = Table(
        title=f"slow consumer: {rate:,}/s produced for {seconds:g} s, applied at {rate // 10:,}/s"
    )
    columns = (
        "commit_rate",
        "worst_second",
        "producer_growth_mib",
        "producer_peak_mib",
        "consumer_peak_mib",
        "broker_growth_mib",
    )
    table.add_column("system")
    for column in columns:
        table.add_column(column.replace("_", " "), justify="right")
    for system, figures in runs.items():
        for f in figures:
            table.add_row(system, *(f"{f[c]:,.0f}" if c in f else "-" for c in columns))
    console.print(table)
    results = {"rate": rate, "seconds": seconds, "runs": runs}
    save("slow_consumer", results, quick, partial=broker is None)
    return results


if __name__ == "__main__":
    raise SystemExit(workload_main("python -m bench.slow.run", __doc__, run, None))
