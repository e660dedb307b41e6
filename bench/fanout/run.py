"""The fan-out workload's driver (the package's docstring): streamq (its producer's
embedded server, and ``streamq serve``), NATS JetStream and Kafka side by side, each
system's runs alternating with the others'.

``python -m bench.fanout.run [--quick] [--repeats N] [--consumers 1,10,100] [--rates 1000]
[--no-kafka] [--no-nats]``.
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.progress import Progress
from rich.table import Table

from ..common import (
    Child,
    alternating,
    baselines_of,
    console,
    pin,
    proc_cpu_seconds,
    save,
    workload_main,
)
from ..measure import Latencies
from ..nats.server import NatsServer, recorded_settings
from . import cores

CONSUMERS = [1, 10, 100, 300, 1_000]
RATES = [1_000, 10_000]
QUICK_CONSUMERS = [1, 10, 100]
QUICK_RATES = [1_000]
SECONDS, QUICK_SECONDS = 10.0, 2.0  # of publishing, per run
PER_PROCESS = 250  # consumers in one process at most
# Each system's run before the measured ones, not recorded: a fresh Kafka broker's JVM
# takes about 10 s of this traffic to settle (its JIT: 1.3 ms of CPU a record at first,
# 0.5 ms after 16 s), and everything's first connections and caches are made.
WARM_UP_CONSUMERS, WARM_UP_SECONDS = 10, 10.0
SYSTEMS = ("streamq", "streamq serve", "kafka", "nats")
STREAMQ = ("streamq", "streamq serve")  # the systems given a ratio against each baseline
READY_TIMEOUT = 300.0  # s for a process of consumers to connect them all
DRAIN_TIMEOUT = 300.0  # s after the last publish for every consumer to have every record


@dataclass(frozen=True)
class Side:
    """A system's serving side in one run, ready: the process whose CPU is measured, the
    producer (told GO), and how to start a process of its consumers."""

    serving_pid: int
    producer: Child
    consumers: str  # the module of its consumer processes
    address: Sequence[object]  # their arguments before COUNT TOTAL


@contextlib.contextmanager
def streamq_side(folder: Path, rate: int, seconds: float) -> Iterator[Side]:
    """The producer process, serving."""
    programs = "bench.fanout.streamq"
    with Child(programs, "producer", folder / "p.db", rate, seconds) as producer:
        (address,) = producer.expect("READY")
        yield Side(producer.process.pid, producer, programs, [address])


@contextlib.contextmanager
def streamq_serve_side(folder: Path, rate: int, seconds: float) -> Iterator[Side]:
    """A producer process that does not serve, and ``streamq serve`` on its database."""
    programs, db = "bench.fanout.streamq", folder / "p.db"
    with Child(programs, "publisher", db, rate, seconds) as producer:
        producer.expect("READY")  # the database and its stream made
        with Child("streamq", "serve", db, "--port", 0) as server:
            address = server.expect("serving")[-1]
            yield Side(server.process.pid, producer, programs, [address])


@contextlib.contextmanager
def kafka_side(broker: Any, rate: int, seconds: float) -> Iterator[Side]:
    """A topic of one partition on the broker, and the producer."""
    topic = f"fanout-{uuid.uuid4().hex[:8]}"
    broker.create_topic(topic, 1)
    programs = "bench.fanout.kafka"
    try:
        with Child(programs, "producer", broker.bootstrap, topic, rate, seconds) as producer:
            producer.expect("READY")
            yield Side(broker.pid, producer, programs, [broker.bootstrap, topic])
    finally:
        broker.delete_topic(topic)


@contextlib.contextmanager
def nats_side(server: NatsServer, rate: int, seconds: float) -> Iterator[Side]:
    """A stream on the server, and the producer."""
    programs = "bench.fanout.nats"
    with (
        server.stream("fanout") as stream,
        Child(programs, "producer", server.url, stream, rate, seconds) as producer,
    ):
        producer.expect("READY")
        assert server.pid is not None
        yield Side(server.pid, producer, programs, [server.url, stream])


def split(consumers: int) -> list[int]:
    """Consumers per process: as few processes as ``PER_PROCESS`` allows, evenly."""
    processes = max(1, math.ceil(consumers / PER_PROCESS))
    return [consumers // processes + (i < consumers % processes) for i in range(processes)]


def measure(side: Side, consumers: int, rate: int, seconds: float) -> dict[str, Any]:
    """One run: the consumers connected and pinned, the serving side pinned, then the
    records published; the serving process's CPU over the publishing window (from START
    to PUBLISHED); what every consumer received by ``DRAIN_TIMEOUT`` after."""
    total = int(rate * seconds)
    serving_cores, consumer_cores = cores()
    everywhere = serving_cores | consumer_cores
    producer = side.producer
    with contextlib.ExitStack() as stack:
        children = [
            stack.enter_context(Child(side.consumers, "consumers", *side.address, n, total))
            for n in split(consumers)
        ]
        for child in children:
            child.expect("READY", timeout=READY_TIMEOUT)
            pin(child.process.pid, consumer_cores)
        # A shared server (the Kafka broker) gets every core back, whatever happens.
        stack.callback(lambda: _unpin(side.serving_pid, everywhere))
        for pid in {side.serving_pid, producer.process.pid}:
            pin(pid, serving_cores)
        producer.send("GO")
        producer.expect("START")
        pids = [side.serving_pid, producer.process.pid, *(c.process.pid for c in children)]
        cpu = [proc_cpu_seconds(pid) for pid in pids]
        began = time.monotonic()
        published = producer.expect("PUBLISHED", timeout=seconds * 20 + 60)
        window = time.monotonic() - began
        serving_cpu, producer_cpu, *consumers_cpu = (
            proc_cpu_seconds(pid) - before for pid, before in zip(pids, cpu, strict=True)
        )
        done = [_done(child, began + window + DRAIN_TIMEOUT) for child in children]
        producer.send("STOP")
    reached, publish_p50, publish_p99 = map(float, published)
    p50, p99, p999, worst, _ = Latencies.merged(d[3] for d in done).figures()
    return {
        "consumers": consumers,
        "rate": rate,
        "records": total,
        "reached": reached,
        "window_s": window,
        "serving_cpu_s": serving_cpu,
        "serving_core_pct": 100 * serving_cpu / window,
        "serving_us_per_record": serving_cpu / total * 1e6,
        "producer_cpu_s": producer_cpu,  # the same process as the server's for streamq
        # The consumers' processes over the same window: what receiving costs them.
        "consumers_core_pct": 100 * sum(consumers_cpu) / window,
        "publish_p50_us": publish_p50,
        "publish_p99_us": publish_p99,
        "p50_us": p50,
        "p99_us": p99,
        "p999_us": p999,
        "max_us": worst,
        "delivered": sum(int(d[0]) for d in done),
        "skipped": sum(int(d[1]) for d in done),
        "repeated": sum(int(d[2]) for d in done),
        "expected": total * consumers,
    }


def _done(child: Child, deadline: float) -> list[str]:
    """A consumer process's DONE: once it has every record, or what it has at
    ``deadline`` (told STOP)."""
    try:
        return child.expect("DONE", timeout=max(1.0, deadline - time.monotonic()))
    except TimeoutError:
        child.send("STOP")
        return child.expect("DONE", timeout=60)


def _unpin(pid: int, cpus: set[int]) -> None:
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # it has ended
        pin(pid, cpus)


def run_system(
    system: str,
    consumers: int,
    rate: int,
    seconds: float,
    broker: Any = None,
    nats_server: NatsServer | None = None,
) -> dict[str, Any]:
    """One run of ``system`` (one of ``SYSTEMS``), every process it started stopped."""
    with contextlib.ExitStack() as stack:
        if system == "kafka":
            side = stack.enter_context(kafka_side(broker, rate, seconds))
        elif system == "nats":
            assert nats_server is not None
            side = stack.enter_context(nats_side(nats_server, rate, seconds))
        else:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            start = streamq_side if system == "streamq" else streamq_serve_side
            side = stack.enter_context(start(folder, rate, seconds))
        return {"system": system, **measure(side, consumers, rate, seconds)}


def medians(runs: list[dict[str, Any]]) -> dict[tuple[int, int, str], dict[str, float]]:
    """(rate, consumers, system) -> the median of each figure over its runs."""
    grouped: dict[tuple[int, int, str], list[dict[str, Any]]] = {}
    for r in runs:
        grouped.setdefault((r["rate"], r["consumers"], r["system"]), []).append(r)
    return {
        key: {
            name: statistics.median(r[name] for r in repeats)
            for name, value in repeats[0].items()
            if isinstance(value, int | float)
        }
        for key, repeats in grouped.items()
    }


def table(runs: list[dict[str, Any]], seconds: float) -> Table:
    """Medians per rate, N and system; streamq's serving CPU and p99 over each baseline's."""
    figures = medians(runs)
    baselines = baselines_of(system for _, _, system in figures)
    title = f"fan-out: one producer, N consumers ({seconds:g} s of publishing per run)"
    out = Table(title=title)
    columns = [
        "rate/s",
        "N",
        "system",
        "reached/s",
        "serving CPU % core",
        "µs/record",
        "consumers CPU % core",
        "publish p50 µs",
        "publish p99 µs",
        "p50 µs",
        "p99 µs",
        "delivered",
        *(f"CPU vs {b}" for b in baselines),
        *(f"p99 vs {b}" for b in baselines),
    ]
    for column in columns:
        out.add_column(column, justify="left" if column == "system" else "right")
    for (rate, n, system), m in figures.items():
        ratios = []
        for figure in ("serving_us_per_record", "p99_us"):
            for b in baselines:
                base = figures.get((rate, n, b), {}).get(figure)
                ratios.append(f"{m[figure] / base:.2f}x" if system in STREAMQ and base else "")
        out.add_row(
            f"{rate:,}",
            f"{n:,}",
            system,
            f"{m['reached']:,.0f}",
            f"{m['serving_core_pct']:.1f}",
            f"{m['serving_us_per_record']:,.1f}",
            f"{m['consumers_core_pct']:.1f}" if "consumers_core_pct" in m else "",
            f"{m['publish_p50_us']:,.0f}",
            f"{m['publish_p99_us']:,.0f}",
            f"{m['p50_us']:,.0f}",
            f"{m['p99_us']:,.0f}",
            f"{m['delivered']:,.0f}/{m['expected']:,.0f}",
            *ratios,
        )
    return out


def run(
    broker: Any | None,
    quick: bool,
    repeats: int,
    nats: bool = True,
    consumers: Sequence[int] | None = None,
    rates: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Every N at every rate, each system in turn (Kafka with a broker, NATS if ``nats``)."""
    seconds = QUICK_SECONDS if quick else SECONDS
    consumers = list(consumers or (QUICK_CONSUMERS if quick else CONSUMERS))
    rates = list(rates or (QUICK_RATES if quick else RATES))
    systems = [s for s in SYSTEMS if (s != "kafka" or broker is not None) and (s != "nats" or nats)]
    runs: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(NatsServer()) if nats else None
        if server is not None:
            console.print(f"[bold]nats server[/] {server.url} {json.dumps(server.config)}")
        progress = stack.enter_context(Progress(console=console, transient=True))
        warming = progress.add_task("fanout warm-up", total=len(systems))
        for system in systems:
            run_system(system, WARM_UP_CONSUMERS, rates[0], WARM_UP_SECONDS, broker, server)
            progress.advance(warming)
        task = progress.add_task(
            "fanout", total=len(rates) * len(consumers) * repeats * len(systems)
        )
        for rate in rates:
            for n in consumers:
                for system in alternating(systems, repeats):
                    runs.append(run_system(system, n, rate, seconds, broker, server))
                    progress.advance(task)
        nats_settings = recorded_settings({"normal": server}) if server is not None else None
    console.print(table(runs, seconds))
    serving, consuming = cores()
    results: dict[str, Any] = {
        "seconds_per_run": seconds,
        "sizes": {"consumers": consumers, "rates": rates, "per_process": PER_PROCESS},
        "warm_up": {"consumers": WARM_UP_CONSUMERS, "seconds": WARM_UP_SECONDS},
        "cores": {"serving": sorted(serving), "consumers": sorted(consuming)},
        "runs": runs,
    }
    if nats_settings is not None:
        results["nats"] = nats_settings
    if broker is not None:
        from ..kafka.clients import PRODUCER_LATENCY  # confluent_kafka: only with a broker
        from .kafka import CONSUMER_FANOUT

        results["kafka"] = {
            "broker": broker.config,
            "producer": PRODUCER_LATENCY,
            "consumer": CONSUMER_FANOUT,
        }
    save("fanout", results, quick, partial=broker is None or not nats)
    return results


def main(argv: list[str] | None = None) -> int:
    lists = {
        "consumers": "N, comma-separated (1,10,100,300,1000)",
        "rates": "records/s, comma-separated",
    }
    return workload_main("python -m bench.fanout.run", __doc__, run, argv, nats=True, lists=lists)


if __name__ == "__main__":
    sys.exit(main())
