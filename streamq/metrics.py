"""Prometheus metrics of a producer, read from its live state at scrape time.

A custom collector, not counters updated as records flow: publishing and pushing
keep only the plain integers they already had (heads, positions, per-stream
traffic), and a scrape turns them into metrics. prometheus-client serves them
from its own thread, on loopback unless told otherwise; everything read here is
copied first (``list(...)``), so a scrape never races the event loop's changes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from .producer import Producer


class ProducerCollector(Collector):
    """Heads, consumer positions and lag, traffic, connections and errors of one producer."""

    def __init__(self, producer: Producer) -> None:
        self._producer = producer

    def collect(self) -> Iterator[Metric]:
        producer = self._producer
        streams = dict(producer.log.streams)
        info = GaugeMetricFamily(
            "streamq_producer_info", "This producer's id and epoch", labels=["producer_id", "epoch"]
        )
        info.add_metric([producer.producer_id, str(producer.epoch)], 1)
        yield info

        head = GaugeMetricFamily("streamq_stream_head", "Last committed seq", labels=["stream"])
        low = GaugeMetricFamily("streamq_stream_low", "First seq still held", labels=["stream"])
        for name, stream in streams.items():
            head.add_metric([name], stream.head)
            low.add_metric([name], stream.low)
        yield head
        yield low

        labels = ["consumer", "stream"]
        applied = GaugeMetricFamily(
            "streamq_consumer_applied", "Last seq the consumer reported applied", labels=labels
        )
        lag = GaugeMetricFamily(
            "streamq_consumer_lag", "Records committed and not yet applied", labels=labels
        )
        registered = GaugeMetricFamily(
            "streamq_consumer_registered", "1 if retention keeps records for it", labels=labels
        )
        lost = CounterMetricFamily(
            "streamq_consumer_lost_records",
            "Records retention deleted before the consumer applied them",
            labels=labels,
        )
        for position in producer.positions.lags(streams):
            key = [position.consumer, position.stream]
            applied.add_metric(key, position.applied)
            lag.add_metric(key, position.lag)
            registered.add_metric(key, int(position.registered))
            lost.add_metric(key, position.lost)
        yield from (applied, lag, registered, lost)
        if producer.numberer is not None:
            found = producer.numberer.open_transactions
            yield GaugeMetricFamily(
                "streamq_open_transactions",
                "Transactions that published and have not ended (their records wait)",
                found.count,
            )
            yield GaugeMetricFamily(
                "streamq_oldest_open_transaction_seconds",
                "How long the oldest of them has been open (0 with none)",
                found.oldest_age(time.time()),
            )
        yield CounterMetricFamily(
            "streamq_registrations_dropped",
            "Registrations dropped by their limits (max_idle_ms, max_bytes)",
            producer.registrations_dropped,
        )

        server = producer.server
        if server is None:
            return
        records = CounterMetricFamily(
            "streamq_sent_records", "Records sent to consumers and readers", labels=["stream"]
        )
        sent_bytes = CounterMetricFamily(
            "streamq_sent_bytes", "Bytes of RECORDS frames sent", labels=["stream"]
        )
        for name, traffic in list(server.traffic.items()):
            records.add_metric([name], traffic.records)
            sent_bytes.add_metric([name], traffic.bytes)
        yield records
        yield sent_bytes
        yield GaugeMetricFamily("streamq_connections", "Open connections", server.connections)
        yield GaugeMetricFamily(
            "streamq_subscriptions", "Active subscriptions", len(server.subscriptions)
        )
        yield CounterMetricFamily(
            "streamq_errors_sent", "ERROR frames sent to peers", server.errors_sent
        )


class MetricsServer:
    """``/metrics`` over HTTP for one producer, in a thread of prometheus-client's."""

    def __init__(self, producer: Producer, host: str, port: int) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(ProducerCollector(producer))
        self._httpd, self._thread = start_http_server(port, addr=host, registry=self.registry)
        bound_host, bound_port = self._httpd.server_address[:2]
        host_text = str(bound_host)
        self.address = (
            f"[{host_text}]:{bound_port}" if ":" in host_text else f"{host_text}:{bound_port}"
        )

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
