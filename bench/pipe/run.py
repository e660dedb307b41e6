"""Workload 1, pipe: N records of S bytes from a producer process to a consumer process that
applies them exactly once into its own SQLite database. End to end, records/s and MB/s.

Every consumer (streamq, Kafka, NATS JetStream) does the same work per batch: one SQLite
transaction inserting the records and storing the position. The clock runs from the
producer's first publish (GO) to the consumer's commit of the last record.

``python -m bench.pipe.run [--quick] [--repeats N] [--no-kafka] [--no-nats]``.
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

from ..common import (
    Child,
    Series,
    alternating,
    comparison_table,
    console,
    durability_modes,
    save,
    workload_main,
)
from ..nats.server import NatsServer, durability_servers, recorded_settings

FULL = [(1_000_000, 100), (100_000, 10_000)]
QUICK = [(20_000, 100), (2_000, 10_000)]


def _end_to_end(producer: Child, consumer: Child) -> float:
    """Seconds from the producer's first publish to the consumer's last record applied."""
    consumer.expect("READY")
    producer.send("GO")
    start = float(producer.expect("START")[0])
    done = float(consumer.expect("DONE", timeout=600)[0])
    producer.send("STOP")
    return done - start


def run_streamq(folder: Path, count: int, size: int, mode: str = "normal") -> float:
    programs = "bench.pipe.streamq"
    with Child(programs, "producer", folder / "producer.db", count, size, mode) as producer:
        (address,) = producer.expect("READY")
        with Child(programs, "consumer", address, folder / "consumer.db", count, mode) as c:
            return _end_to_end(producer, c)


def run_kafka(broker: Any, folder: Path, count: int, size: int, mode: str = "normal") -> float:
    topic = f"pipe-{uuid.uuid4().hex[:8]}"
    broker.create_topic(topic, 1)
    bootstrap = broker.bootstrap
    with Child("bench.pipe.kafka", "producer", bootstrap, topic, count, size) as producer:
        producer.expect("READY")
        db = folder / "kafka.db"
        with Child("bench.pipe.kafka", "consumer", bootstrap, topic, db, count, mode) as c:
            return _end_to_end(producer, c)


def run_nats(
    server: NatsServer, folder: Path, count: int, size: int, mode: str = "normal"
) -> float:
    programs, url, db = "bench.pipe.nats", server.url, folder / "nats.db"
    with (
        server.stream("pipe") as stream,
        Child(programs, "producer", url, stream, count, size) as producer,
    ):
        producer.expect("READY")
        with Child(programs, "consumer", url, stream, db, count, size, mode) as c:
            return _end_to_end(producer, c)


def run(broker: Any | None, quick: bool, repeats: int, nats: bool = True) -> dict[str, Any]:
    """Every case in both durability modes; NATS too unless ``nats`` is False."""
    cases = QUICK if quick else FULL
    series: list[Series] = []
    systems = ["streamq"] + (["kafka"] if broker is not None else []) + (["nats"] if nats else [])
    with (
        durability_modes(broker) as modes,
        durability_servers(nats) as nats_servers,
        Progress(console=console, transient=True) as progress,
    ):
        for mode, server in nats_servers.items():
            console.print(f"[bold]nats server {mode}[/] {server.url} {json.dumps(server.config)}")
        task = progress.add_task("pipe", total=len(modes) * len(cases) * repeats * len(systems))
        for mode, mode_broker in modes:
            for count, size in cases:
                case = f"{count:,} x {size:,} B {mode}"
                rates = {s: Series(s, case, "rec/s") for s in systems}
                for system in alternating(systems, repeats):
                    with tempfile.TemporaryDirectory() as folder:
                        if system == "streamq":
                            seconds = run_streamq(Path(folder), count, size, mode)
                        elif system == "nats":
                            seconds = run_nats(nats_servers[mode], Path(folder), count, size, mode)
                        else:
                            seconds = run_kafka(mode_broker, Path(folder), count, size, mode)
                    rates[system].values.append(count / seconds)
                    progress.advance(task)
                series += rates.values()
    console.print(comparison_table("pipe: end-to-end records/s, applied exactly once", series))
    for s in series:
        size = int(s.case.split(" x ")[1].split(" B")[0].replace(",", ""))
        console.print(f"  {s.system:8} {s.case:>25}: {s.median * size / 1e6:,.1f} MB/s")
    results: dict[str, Any] = {
        "series": [asdict(s) for s in series],
    }
    if nats_servers:
        results["nats"] = recorded_settings(nats_servers)
    save("pipe", results, quick, partial=broker is None or not nats)
    return results


def main(argv: list[str] | None = None) -> int:
    return workload_main("python -m bench.pipe.run", __doc__, run, argv, nats=True)


if __name__ == "__main__":
    sys.exit(main())
