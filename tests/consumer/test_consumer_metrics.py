"""A consumer's own Prometheus metrics, scraped over real HTTP on loopback: its endpoint
(``metrics_port=``), a producer's endpoint in the same process (``metrics=producer``), and
a ``FanInConsumer``'s one endpoint for all its producers."""

from __future__ import annotations

import asyncio
import re
import socket
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from streamq import Batch, Consumer, ConsumerCollector, DeadLetter, FanInConsumer, Producer

from ..conftest import wait_for
from ..producer.test_lag import scrape

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def of(samples: Samples, consumer: Consumer) -> dict[str, float]:
    """``consumer``'s samples, by metric name (its labels: name, stream, address)."""
    labels = (("address", consumer.address), ("consumer", consumer.name), ("stream", "orders"))
    return {name: value for (name, found), value in samples.items() if found == labels}


def credit(tx: Any, batch: Batch) -> int:
    tx.execute(
        "CREATE TABLE IF NOT EXISTS credits "
        "(producer TEXT, seq INTEGER, cents INTEGER, PRIMARY KEY (producer, seq))"
    )
    for record in batch:
        row = (batch.producer_id, record.seq, int(record.value))
        tx.execute("INSERT INTO credits VALUES (?, ?, ?)", row)
    return len(batch)


async def publish(producer: Producer, *values: bytes) -> None:
    """In one transaction: the consumer gets them as one batch."""
    async with producer.transaction() as tx:
        await tx.publish_many("orders", list(values))


async def test_a_consumer_serves_its_own_metrics(producer_db: str, consumer_db: str) -> None:
    async with Producer(producer_db) as producer:
        await publish(producer, b"1", b"2")
        consumer = Consumer(
            producer.address,
            "orders",
            db=consumer_db,
            name="billing",
            on_failure=DeadLetter(),
            metrics_port=0,
        )
        async with consumer:
            assert consumer.metrics_address.startswith("127.0.0.1:")
            await consumer.apply(await anext(consumer), credit)
            await publish(producer, b"3", b"oops", b"5")  # a poison record, parked
            await consumer.apply(await anext(consumer), credit)
            metrics = await asyncio.to_thread(scrape, consumer.metrics_address)
            assert of(metrics, consumer) == {
                "streamq_consumer_applied_seq": 5,
                "streamq_consumer_seen_lag": 0,
                "streamq_consumer_records_applied_total": 4,
                "streamq_consumer_batches_applied_total": 2,
                "streamq_consumer_records_parked_total": 1,
                "streamq_consumer_batches_retried_total": 0,
                "streamq_consumer_records_reapplied_total": 0,
                "streamq_consumer_reconnects_total": 0,
            }
            [info] = [labels for name, labels in metrics if name == "streamq_consumer_info"]
            assert dict(info) == {
                "consumer": "billing",
                "stream": "orders",
                "address": producer.address,
                "producer_id": producer.producer_id,
            }

            # Published, received, not applied yet: the lag this consumer sees.
            await publish(producer, b"6", b"7")
            await wait_for(lambda: consumer.head == 7, what="the producer's head reported")
            metrics = await asyncio.to_thread(scrape, consumer.metrics_address)
            assert of(metrics, consumer)["streamq_consumer_seen_lag"] == 2
            assert of(metrics, consumer)["streamq_consumer_applied_seq"] == 5
            address = consumer.metrics_address
        with pytest.raises(urllib.error.URLError):  # closed with the consumer
            await asyncio.to_thread(scrape, address)


async def test_consumers_report_through_their_producers_endpoint(
    producer_db: str, consumer_db: str
) -> None:
    async with Producer(producer_db, metrics_port=0) as producer:
        await publish(producer, b"1", b"2", b"3")
        async with Consumer(
            producer.address, "orders", db=consumer_db, name="billing", metrics=producer
        ) as consumer:
            await consumer.apply(await anext(consumer), credit)
            metrics = await asyncio.to_thread(scrape, producer.metrics_address)
            assert metrics[("streamq_stream_head", (("stream", "orders"),))] == 3  # the producer's
            assert of(metrics, consumer)["streamq_consumer_applied_seq"] == 3
            assert of(metrics, consumer)["streamq_consumer_batches_applied_total"] == 1
        metrics = await asyncio.to_thread(scrape, producer.metrics_address)
        assert of(metrics, consumer) == {}  # removed at close
        assert metrics[("streamq_stream_head", (("stream", "orders"),))] == 3


async def test_a_collector_holds_a_fan_in_consumers_producers(
    tmp_path: Path, consumer_db: str
) -> None:
    async with (
        Producer(str(tmp_path / "a.db")) as a,
        Producer(str(tmp_path / "b.db")) as b,
    ):
        await publish(a, b"1", b"2")
        await publish(b, b"10")
        async with FanInConsumer(
            [a.address, b.address], "orders", db=consumer_db, name="billing", metrics_port=0
        ) as fanin:
            for _ in range(2):
                await fanin.apply(await anext(fanin), credit)
            metrics = await asyncio.to_thread(scrape, fanin.metrics_address)
            first, second = fanin.consumers
            assert of(metrics, first)["streamq_consumer_records_applied_total"] == 2
            assert of(metrics, second)["streamq_consumer_records_applied_total"] == 1
            assert of(metrics, second)["streamq_consumer_applied_seq"] == 1

    # A collector of the caller's: several consumers, added and removed.
    collector = ConsumerCollector()
    one = Consumer("127.0.0.1:1", "orders", name="one")
    two = Consumer("127.0.0.1:2", "orders", name="two")
    collector.add(one)
    collector.add(two)
    collector.add(one)  # once
    assert {s.labels["consumer"] for m in collector.collect() for s in m.samples} == {"one", "two"}
    collector.remove(one)
    collector.remove(one)
    assert {s.labels["consumer"] for m in collector.collect() for s in m.samples} == {"two"}


async def test_metrics_mistakes_say_what_was_asked(producer_db: str) -> None:
    with pytest.raises(ValueError, match=r"metrics_port= .* or metrics= .* not both"):
        Consumer("127.0.0.1:1", "orders", metrics_port=0, metrics=ConsumerCollector())
    with pytest.raises(RuntimeError, match=r"serves no metrics of its own \(metrics_port=None\)"):
        _ = Consumer("127.0.0.1:1", "orders").metrics_address
    async with Producer(producer_db) as producer:  # no metrics_port
        with pytest.raises(ValueError, match="that producer serves no metrics"):
            await Consumer(producer.address, "orders", metrics=producer).start()
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            with pytest.raises(
                OSError, match=re.escape(f"cannot serve metrics on 127.0.0.1:{port}: ")
            ):
                await Consumer(producer.address, "orders", metrics_port=port).start()
