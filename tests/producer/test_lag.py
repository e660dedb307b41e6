"""Lag you can see: positions consumers report, wait_applied, status and Prometheus metrics."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

import streamq
from streamq import Consumer, Producer
from streamq.producer.consumer_positions import SHARE_LAG_LIMIT, Positions

from ..conftest import wait_for
from ..test_cli import wait_for_head


async def apply_until(consumer: Consumer, until: int) -> None:
    """Apply batches (into table ``seen``) until seq ``until`` is applied."""
    async for batch in consumer:
        async with consumer.transaction(batch) as tx:
            await tx.execute("CREATE TABLE IF NOT EXISTS seen (seq INTEGER)")
            await tx.executemany("INSERT INTO seen VALUES (?)", [(r.seq,) for r in batch])
        if batch.last_seq >= until:
            return


def status(address: str) -> dict[str, Any]:
    with streamq.Client(address) as client:
        return client.status()


def lag_of(producer: Producer, consumer: str, stream: str) -> streamq.ConsumerLag | None:
    return next(
        (p for p in producer.consumer_lags() if (p.consumer, p.stream) == (consumer, stream)), None
    )


@pytest.fixture
def producer_db(either_producer_db: str) -> str:
    """Lag, metrics and wait_applied come from the server's memory: the same on both
    engines, which these tests check."""
    return either_producer_db


async def test_producer_and_consumer_know_the_lag(producer_db: str, consumer_db: str) -> None:
    async with Producer(producer_db) as producer:
        async with producer.transaction() as tx:
            await tx.publish_many("orders", [b"x"] * 100)
        consumer = Consumer(
            producer.address, "orders", db=consumer_db, name="billing", max_batch_records=40
        )
        async with consumer:
            await wait_for(lambda: consumer.head == 100, what="the consumer to see the head")
            assert consumer.lag == 100 and consumer.applied == 0
            await apply_until(consumer, 40)
            assert consumer.applied >= 40
            assert consumer.lag == 100 - consumer.applied

            def producer_sees_applied() -> bool:
                lag = lag_of(producer, "billing", "orders")
                return lag is not None and lag.applied == consumer.applied

            await wait_for(producer_sees_applied, what="the ACK")
            lag = lag_of(producer, "billing", "orders")
            assert lag is not None and lag.head == 100 and lag.lag == 100 - consumer.applied
            assert not lag.registered
            (position,) = (await asyncio.to_thread(status, producer.address))["positions"]
            assert position["consumer"] == "billing" and position["lag"] == lag.lag

            await producer.publish("orders", b"y")
            await wait_for(lambda: consumer.head == 101, what="the new head")
            assert consumer.lag == 101 - consumer.applied
            # Asked, the producer tells the head even before pushing it.
            async with producer.transaction() as tx:
                await tx.publish_many("orders", [b"z"] * 5)
            assert await consumer.fetch_lag() == 106 - consumer.applied


async def test_wait_applied_resolves_on_the_report(producer_db: str, consumer_db: str) -> None:
    async with Producer(producer_db) as producer:
        await producer.create_stream("orders")
        async with Consumer(producer.address, "orders", db=consumer_db, name="billing") as consumer:
            seq = await producer.publish("orders", b"order 1")
            waiter = asyncio.create_task(
                producer.wait_applied("billing", "orders", seq, timeout=10)
            )
            await asyncio.sleep(0)
            assert not waiter.done()  # nothing applied yet
            await apply_until(consumer, seq)
            assert await waiter >= seq
            # Already applied: at once. Never applied: the timeout.
            assert await producer.wait_applied("billing", "orders", seq, timeout=0) == seq
            with pytest.raises(TimeoutError):
                await producer.wait_applied("billing", "orders", seq + 1, timeout=0.05)
            assert producer.positions.waiting() == 0  # the timed-out waiter left
            # Waiting for a consumer never heard of invents no consumer.
            with pytest.raises(TimeoutError):
                await producer.wait_applied("nobody", "orders", 1, timeout=0.01)
            assert {p.consumer for p in producer.consumer_lags()} == {"billing"}


async def test_acks_wait_out_the_interval_and_closing_sends_the_last(
    producer_db: str, consumer_db: str
) -> None:
    """The first batch is acknowledged at once; one applied within ``ack_interval`` of
    that ACK waits for the interval's end (here: never, before the close), and the close
    sends the newest position before the connection goes."""
    async with Producer(producer_db) as producer:
        await producer.create_stream("orders")
        consumer = Consumer(
            producer.address, "orders", db=consumer_db, name="billing", ack_interval=3600
        )
        async with consumer:
            first = await producer.publish("orders", b"order 1")
            await apply_until(consumer, first)
            assert await producer.wait_applied("billing", "orders", first, timeout=10) == first
            second = await producer.publish("orders", b"order 2")
            await apply_until(consumer, second)
            assert consumer.applied == second and consumer.subscription._ack_timer is not None
            lag = lag_of(producer, "billing", "orders")
            assert lag is not None and lag.applied == first  # no ACK for it yet
        assert await producer.wait_applied("billing", "orders", second, timeout=10) == second


async def test_without_an_interval_every_batch_is_acknowledged(
    producer_db: str, consumer_db: str
) -> None:
    async with Producer(producer_db) as producer:
        await producer.create_stream("orders")
        consumer = Consumer(
            producer.address, "orders", db=consumer_db, name="billing", ack_interval=0
        )
        async with consumer:
            for n in range(1, 4):
                seq = await producer.publish("orders", b"order %d" % n)
                await apply_until(consumer, seq)
                assert consumer.subscription._ack_timer is None
                assert await producer.wait_applied("billing", "orders", seq, timeout=10) == seq


async def test_only_a_connected_unfiltered_consumers_lag_is_exact(
    producer_db: str, consumer_db: str
) -> None:
    """The producer knows what a consumer owes now only while it is subscribed (its ACKs
    follow its commits), and counts it only without a key prefix or headers. Otherwise
    the lag is head - applied, or as of its last report: an upper bound."""
    async with Producer(producer_db) as producer:
        await producer.publish("orders", b"x", key=b"order-1")
        paid = streamq.Filter(key_prefix=b"order-")
        consumers = [
            Consumer(producer.address, "orders", db=consumer_db, name="billing"),
            Consumer(producer.address, "orders", db=consumer_db, name="paid", filter=paid),
        ]
        async with consumers[0], consumers[1]:
            for consumer in consumers:
                await apply_until(consumer, 1)
                await producer.wait_applied(consumer.name, "orders", 1, timeout=10)
            await producer.publish("orders", b"y", key=b"order-2")
            lags = {lag.consumer: lag for lag in producer.consumer_lags()}
            positions = (await asyncio.to_thread(status, producer.address))["positions"]
            shown = {p["consumer"]: (p["lag"], p["exact"], p["connected"]) for p in positions}
        assert {n: (lag.lag, lag.exact, lag.connected) for n, lag in lags.items()} == shown
        assert shown == {"billing": (1, True, True), "paid": (1, False, True)}

        await wait_for(
            lambda: not any(lag.connected for lag in producer.consumer_lags()), what="closes"
        )
        # Gone: as of their last reports, whatever they committed since.
        assert [(lag.lag, lag.exact) for lag in producer.consumer_lags()] == [(1, False)] * 2


def test_a_negative_ack_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="ack_interval"):
        Consumer("127.0.0.1:1", "orders", ack_interval=-1)


async def test_spark_style_reports_count_as_positions(producer_db: str) -> None:
    async with Producer(producer_db) as producer:
        async with producer.transaction() as tx:
            await tx.publish_many("orders", [b"x"] * 10)
        waiter = asyncio.create_task(producer.wait_applied("spark", "orders", 7, timeout=10))

        def report() -> None:
            with streamq.Client(producer.address) as client:
                client.report_position("orders", "spark", 8)

        await asyncio.to_thread(report)
        assert await waiter == 8
        lag = lag_of(producer, "spark", "orders")
        assert lag is not None and (lag.applied, lag.lag) == (8, 2)


async def test_positions_beyond_what_was_sent_are_clamped(producer_db: str) -> None:
    """A report past the head (or an ACK past what was sent) would let retention delete
    what a registered consumer still needs: the producer counts no more than it holds."""
    async with Producer(producer_db) as producer:
        await producer.register_consumer("ledger", "orders")
        async with producer.transaction() as tx:
            await tx.publish_many("orders", [b"x"] * 10)

        def report() -> None:
            with streamq.Client(producer.address) as client:
                client.report_position("orders", "ledger", 1_000_000)

        await asyncio.to_thread(report)
        lag = lag_of(producer, "ledger", "orders")
        assert lag is not None and (lag.applied, lag.lag) == (10, 0)
        async with producer.transaction() as tx:
            await tx.publish_many("orders", [b"y"] * 5)
        assert lag_of(producer, "ledger", "orders").lag == 5  # type: ignore[union-attr]
        await producer.apply_retention()
        assert producer.log.stream("orders").low == 11  # the 5 new records are kept


async def test_a_reconnecting_consumer_reports_its_position_at_once(
    producer_db: str, consumer_db: str, unused_tcp_port: int
) -> None:
    consumer = Consumer(f"127.0.0.1:{unused_tcp_port}", "orders", db=consumer_db, name="billing")
    async with Producer(producer_db, port=unused_tcp_port) as producer:
        async with producer.transaction() as tx:
            await tx.publish_many("orders", [b"x"] * 5)
        async with consumer:
            await apply_until(consumer, 5)
    # A new producer process knows the position as it was saved; the consumer, reconnecting,
    # says where it is at once (and would, to a producer that had forgotten it).
    async with Producer(producer_db, port=unused_tcp_port) as producer:
        saved = lag_of(producer, "billing", "orders")
        assert saved is not None and saved.applied == 5
        assert await producer.forget_consumer("billing", "orders")
        async with Consumer(producer.address, "orders", db=consumer_db, name="billing"):
            await producer.wait_applied("billing", "orders", 5, timeout=10)


def scrape(address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_prometheus_metrics_read_live_state(producer_db: str, consumer_db: str) -> None:
    async with Producer(producer_db, metrics_port=0) as producer:
        assert producer.metrics_address.startswith("127.0.0.1:")
        async with producer.transaction() as tx:
            await tx.publish_many("orders", [b"0123456789"] * 50)
        await producer.register_consumer("audit", "orders")
        async with Consumer(producer.address, "orders", db=consumer_db, name="billing") as consumer:
            await apply_until(consumer, 50)
            await producer.wait_applied("billing", "orders", 50, timeout=10)
            metrics = await asyncio.to_thread(scrape, producer.metrics_address)
        stream = (("stream", "orders"),)
        billing = (("consumer", "billing"), ("stream", "orders"))
        audit = (("consumer", "audit"), ("stream", "orders"))
        assert metrics[("streamq_stream_head", stream)] == 50
        assert metrics[("streamq_stream_low", stream)] == 1
        assert metrics[("streamq_consumer_applied", billing)] == 50
        assert metrics[("streamq_consumer_lag", billing)] == 0
        assert metrics[("streamq_consumer_lag", audit)] == 50
        assert metrics[("streamq_consumer_registered", audit)] == 1
        assert metrics[("streamq_sent_records_total", stream)] == 50
        async with producer.storage.reader() as reader:  # as stored, whatever the engine
            runs = await reader.read_runs(producer.log.streams["orders"].id, 1, 51, 100)
        stored = sum(len(data) for *_, data in runs)
        # Frames: the stored record encodings plus a few bytes of framing each.
        assert stored < metrics[("streamq_sent_bytes_total", stream)] < stored + 100
        assert metrics[("streamq_connections", ())] >= 1
        assert metrics[("streamq_errors_sent_total", ())] == 0
        assert metrics[("streamq_commit_watch", ())] == 1  # inotify (Linux) or NOTIFY
        info = [k for k in metrics if k[0] == "streamq_producer_info"]
        assert dict(info[0][1])["producer_id"] == producer.producer_id


def test_serve_exports_metrics_and_status_shows_lag(tmp_path: Path) -> None:
    db = str(tmp_path / "orders.db")
    command = [sys.executable, "-m", "streamq"]
    serving = subprocess.Popen(
        [*command, "serve", db, "--init", "--port", "0", "--metrics-port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert serving.stdout is not None
        first = serving.stdout.readline()
        assert first.startswith("serving producer"), first + serving.stderr.read()
        address = first.rsplit(" on ", 1)[1].strip()
        serving.stdout.readline()  # streams
        metrics_line = serving.stdout.readline()
        assert metrics_line.startswith("metrics: http://127.0.0.1:"), metrics_line
        metrics_address = metrics_line.split("//")[1].split("/")[0]
        published = subprocess.run(
            [*command, "publish", db, "orders", "a", "b", "c"], capture_output=True, timeout=60
        )
        assert published.returncode == 0
        wait_for_head(address, "orders", 3)  # the server notices the other writer
        with streamq.Client(address) as client:
            client.report_position("orders", "spark", 1)
        metrics = scrape(metrics_address)
        assert metrics[("streamq_consumer_lag", (("consumer", "spark"), ("stream", "orders")))] == 2
        table = subprocess.run(
            [*command, "status", address], capture_output=True, text=True, timeout=60
        )
        assert table.returncode == 0, table.stderr
        (row,) = [line for line in table.stdout.splitlines() if "spark" in line]
        # A Spark query holds no subscription: its figures are as of its last report.
        cells = [cell.strip() for cell in row.split("│")[1:-1]]
        assert cells[:4] == ["spark", "orders", "1", "≤ 2"] and cells[-1] == "no"
        assert "A consumer not connected is shown as of its last report" in table.stdout
    finally:
        serving.terminate()
        serving.communicate(timeout=30)
    assert serving.returncode == 0


def test_sync_producer_waits_for_a_consumer(producer_db: str) -> None:
    with streamq.SyncProducer(producer_db) as producer:
        seq = producer.publish("orders", b"order 1")
        producer.register_consumer("spark", "orders")
        with pytest.raises(TimeoutError):
            producer.wait_applied("spark", "orders", seq, timeout=0.01)
        with streamq.Client(producer.address) as client:
            client.report_position("orders", "spark", seq)
        assert producer.wait_applied("spark", "orders", seq, timeout=10) == seq
        (lag,) = producer.consumer_lags()
        assert (lag.consumer, lag.applied, lag.lag, lag.registered) == ("spark", 1, 0, True)
        assert producer.apply_retention()[0].low == 2  # the one registered consumer applied it
        assert producer.unregister_consumer("spark", "orders")


@given(
    st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 50)), max_size=40),
    st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 60)), max_size=6),
)
def test_positions_move_forward_and_wake_exactly_the_reached_waits(
    reports: list[tuple[str, int]], waits: list[tuple[str, int]]
) -> None:
    async def scenario() -> None:
        positions = Positions()
        tasks = [asyncio.create_task(positions.wait(c, "s", seq)) for c, seq in waits]
        await asyncio.sleep(0)  # every wait registered
        best: dict[str, int] = {}
        for consumer, seq in reports:
            positions.report(consumer, "s", seq)
            best[consumer] = max(best.get(consumer, 0), seq)
            position = positions.get(consumer, "s")
            assert position is not None and position.applied == best[consumer]
        await asyncio.sleep(0)  # resolved futures wake their tasks
        for task, (consumer, seq) in zip(tasks, waits, strict=True):
            reached = best.get(consumer, 0) >= seq
            assert task.done() == reached
            if reached:
                assert task.result() >= seq
            else:
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert positions.waiting() == 0  # resolved and cancelled waits leave nothing behind

    asyncio.run(scenario())


async def test_a_shares_lag_counts_its_keys_records(producer_db: str, consumer_db: str) -> None:
    """Six shares caught up, then 120 new records: each share's lag is the number of
    those records of its keys (what the producer will send it), and they sum to 120, not
    720. Beyond what the producer holds in memory or counts, the lag is head - applied,
    flagged inexact."""
    keys = [b"account-%d" % n for n in range(40)]

    async def publish(count: int) -> list[bytes]:
        published = [keys[n % len(keys)] for n in range(count)]
        async with producer.transaction() as tx:
            for key in published:
                await tx.publish("orders", b"x", key=key)
        return published

    async with Producer(producer_db) as producer:
        await publish(60)
        shares = [
            Consumer(producer.address, "orders", db=consumer_db, name="billing", share=(i, 6))
            for i in range(6)
        ]
        try:
            for share in shares:
                await share.start()
                while share.applied < 60:
                    async with share.transaction(await anext(share)):
                        pass
            await wait_for(
                lambda: sum(lag.applied == 60 for lag in producer.consumer_lags()) == 6,
                what="every share's report",
            )
            new = await publish(120)
            lags = {lag.consumer: lag for lag in producer.consumer_lags()}
            owed = [sum(streamq.share_of(key, 6) == i for key in new) for i in range(6)]
            assert [lags[f"billing[{i}/6]"].lag for i in range(6)] == owed
            assert sum(owed) == 120 and all(lag.exact for lag in lags.values())
            # More than it counts: head - applied, said to be an upper bound.
            await publish(SHARE_LAG_LIMIT)
            lags = {lag.consumer: lag for lag in producer.consumer_lags()}
            assert [lags[f"billing[{i}/6]"].lag for i in range(6)] == [SHARE_LAG_LIMIT + 120] * 6
            assert not any(lag.exact for lag in lags.values())
        finally:
            for share in shares:
                await share.close()
