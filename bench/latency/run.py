"""The latency workload's driver: p50, p99, p99.9 and max per rate and system, measured
from the schedule (the package's docstring). Every system (streamq, Kafka, NATS
JetStream) is configured for latency.

``python -m bench.latency.run [--quick] [--repeats N] [--no-kafka] [--no-nats]``.
"""

from __future__ import annotations

import json
import sys
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
    baselines_of,
    console,
    durability_modes,
    percentile_series,
    save,
    workload_main,
)
from ..nats.server import NatsServer, durability_servers, recorded_settings

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


def run_nats(server: NatsServer, rate: int, seconds: float) -> list[int]:
    total = int(rate * seconds)
    programs, url = "bench.latency.nats", server.url
    with (
        server.stream("latency") as stream,
        Child(programs, "producer", url, stream, rate, seconds) as producer,
    ):
        producer.expect("READY")
        with Child(programs, "consumer", url, stream, total) as consumer:
            return _measure(producer, consumer)


def run(broker: Any | None, quick: bool, repeats: int, nats: bool = True) -> dict[str, Any]:
    """Every rate in both durability modes; NATS too unless ``nats`` is False."""
    seconds = 2.0 if quick else 10.0
    systems = ["streamq"] + (["kafka"] if broker is not None else []) + (["nats"] if nats else [])
    # (system, case) -> one list of [p50, p99, p99.9, max] per repeat, in microseconds
    runs: LatencyRuns = {}
    cases: list[str] = []
    with (
        durability_modes(broker) as modes,
        durability_servers(nats) as nats_servers,
        Progress(console=console, transient=True) as progress,
    ):
        for mode, server in nats_servers.items():
            console.print(f"[bold]nats server {mode}[/] {server.url} {json.dumps(server.config)}")
        task = progress.add_task("latency", total=len(modes) * len(RATES) * repeats * len(systems))
        for mode, mode_broker in modes:
            for rate in RATES:
                case = f"{rate:,}/s {mode}"
                cases.append(case)
                for system in alternating(systems, repeats):
                    if system == "streamq":
                        with tempfile.TemporaryDirectory() as folder:
                            figures = run_streamq(Path(folder), rate, seconds, mode)
                    elif system == "nats":
                        figures = run_nats(nats_servers[mode], rate, seconds)
                    else:
                        figures = run_kafka(mode_broker, rate, seconds)
                    runs.setdefault((system, case), []).append(figures)
                    progress.advance(task)

    def median(system: str, case: str, i: int) -> int:
        values = sorted(r[i] for r in runs[(system, case)])
        return values[len(values) // 2]

    table = Table(title=f"latency, publish -> receipt, microseconds ({seconds:g} s per run)")
    baselines = baselines_of(systems)
    for column in ("rate, durability", "system", *PERCENTILES, *(f"p99 vs {b}" for b in baselines)):
        table.add_column(column, justify="right")
    for case in cases:
        for system in systems:
            medians = [median(system, case, i) for i in range(4)]
            ratios = []
            for b in baselines:
                ok = system == "streamq" and (b, case) in runs and median(b, case, 1)
                ratios.append(f"{medians[1] / median(b, case, 1):.2f}x" if ok else "")
            table.add_row(case, system, *(f"{m:,}" for m in medians), *ratios)
    console.print(table)
    series = percentile_series(runs)
    results: dict[str, Any] = {
        "seconds_per_run": seconds,
        "series": [asdict(s) for s in series],
    }
    if nats_servers:
        results["nats"] = recorded_settings(nats_servers)
    save("latency", results, quick, partial=broker is None or not nats)
    return results


def main(argv: list[str] | None = None) -> int:
    return workload_main("python -m bench.latency.run", __doc__, run, argv, nats=True)


if __name__ == "__main__":
    sys.exit(main())
