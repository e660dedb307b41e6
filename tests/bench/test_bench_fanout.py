"""The fan-out workload cannot rot: each system (streamq serving from its producer, and
``streamq serve``; NATS JetStream; Kafka) at tiny size against real servers, every record
reaching every consumer, with the figures the table and the chart are made of."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from rich.console import Console

from bench import charts
from bench.fanout import Tally
from bench.fanout import run as fanout
from bench.kafka.broker import KafkaBroker
from bench.latency import record_value
from bench.nats.server import NatsServer

from ..children import running_children

pytestmark = pytest.mark.timeout(300)  # the broker's start, if no test started it yet

CONSUMERS, RATE, SECONDS = 3, 200, 1.0


@pytest.fixture
def server(nats_server: NatsServer) -> NatsServer:
    return nats_server


def test_every_system_delivers_every_record_to_every_consumer(
    tmp_path: Path, kafka_broker: KafkaBroker, server: NatsServer
) -> None:
    runs = [
        fanout.run_system(system, CONSUMERS, RATE, SECONDS, kafka_broker, server)
        for system in fanout.SYSTEMS
    ]
    expected = int(RATE * SECONDS) * CONSUMERS
    for r in runs:
        delivered = (r["delivered"], r["skipped"], r["repeated"], r["expected"])
        assert delivered == (expected, 0, 0, expected), r
        assert r["reached"] > RATE / 2, r
        assert r["window_s"] >= SECONDS and r["serving_cpu_s"] >= 0, r
        assert 0 < r["publish_p50_us"] <= r["publish_p99_us"], r
        assert 0 < r["p50_us"] <= r["p99_us"] <= r["p999_us"] <= r["max_us"], r
    # The shared broker was pinned to the serving core for its run, and is no longer.
    assert os.sched_getaffinity(kafka_broker.pid) == os.sched_getaffinity(0)
    assert [cmd for pid, cmd in running_children().items() if pid != server.pid] == []

    console = Console(record=True, width=300)
    console.print(fanout.table(runs, SECONDS))
    text = console.export_text()
    assert "CPU vs kafka" in text and "p99 vs nats" in text
    assert text.count(f"{expected:,}/{expected:,}") == len(fanout.SYSTEMS)
    results = {"workload": "fanout", "seconds_per_run": SECONDS, "runs": runs}
    (chart,) = charts.draw(results, tmp_path)
    assert chart.name == "fanout.png" and chart.stat().st_size > 10_000


def test_consumers_split_evenly_over_processes() -> None:
    assert fanout.split(3) == [3]
    assert fanout.split(fanout.PER_PROCESS) == [fanout.PER_PROCESS]
    assert fanout.split(fanout.PER_PROCESS + 1) == [126, 125]
    assert fanout.split(1_000) == [250] * 4


def test_tally_counts_only_records_in_order_as_delivered() -> None:
    """A record missed, repeated or out of order is counted apart: delivered never
    reaches the expected count unless each consumer had every record once, in order."""
    tally = Tally(2, 4)
    values = [record_value(float(n), n) for n in range(4)]
    assert not tally.receive(0, values[:2], 10.0)
    assert tally.receive(0, values[2:], 10.0)
    assert not tally.all_complete
    assert not tally.receive(1, [values[0], values[2], values[1]], 10.0)  # 1 missed, then late
    assert tally.receive(1, [values[3], values[3]], 10.0)
    assert tally.all_complete
    assert (tally.delivered, tally.skipped, tally.repeated) == (4 + 3, 1, 2)
    assert tally.latencies.count == 9
