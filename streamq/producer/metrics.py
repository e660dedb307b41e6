"""A producer's Prometheus metrics: heads, consumers' positions and lag, open
transactions, capture, traffic and errors, read from the live producer at scrape time
(``streamq.metrics`` serves them, beside the metrics consumers report there)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..filters import split_share_name

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from .committed_log import Stream
    from .consumer_positions import ConsumerLag
    from .server import Server
    from .storage import Capturing, Numbering


class ProducerState(Protocol):
    """What a producer's metrics read, at scrape time (a ``Producer``)."""

    @property
    def producer_id(self) -> str: ...
    @property
    def epoch(self) -> int: ...
    def consumer_lags(self) -> list[ConsumerLag]: ...
    @property
    def numberer(self) -> Numbering | None: ...
    @property
    def streams(self) -> Mapping[str, Stream]: ...
    @property
    def registrations_dropped(self) -> int: ...
    @property
    def watching_commits(self) -> bool: ...
    @property
    def server(self) -> Server | None: ...
    @property
    def capture(self) -> Capturing | None: ...


class ProducerCollector(Collector):
    """Heads, consumer positions and lag, traffic, connections and errors of one producer."""

    def __init__(self, producer: ProducerState) -> None:
        self._producer = producer

    def collect(self) -> Iterator[Metric]:
        producer = self._producer
        streams = dict(producer.streams)
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

        yield from _positions(producer)
        yield from _open_transactions(producer)
        yield from _capture(producer)
        yield CounterMetricFamily(
            "streamq_registrations_dropped",
            "Registrations dropped by their limits (max_idle_ms, max_bytes)",
            producer.registrations_dropped,
        )
        server = producer.server
        if server is not None:
            yield GaugeMetricFamily(
                "streamq_commit_watch",
                "1 if other writers' commits wake this producer at once (inotify, NOTIFY); "
                "0 if it finds them by checking periodically",
                int(producer.watching_commits),
            )
            yield from _traffic(server)


def _positions(producer: ProducerState) -> Iterator[Metric]:
    """Each consumer's position and lag per stream, as the producer knows them, and
    whether they are current (``ConsumerLag.connected``, ``exact``)."""
    labels = ["consumer", "stream"]
    applied = GaugeMetricFamily(
        "streamq_consumer_applied",
        "Last seq the consumer reported applied (as of its last report unless connected)",
        labels=labels,
    )
    lag = GaugeMetricFamily(
        "streamq_consumer_lag",
        "Records committed and not yet applied (an upper bound where lag_exact is 0)",
        labels=labels,
    )
    exact = GaugeMetricFamily(
        "streamq_consumer_lag_exact",
        "1 if streamq_consumer_lag is what the consumer owes now; 0: an upper bound (not "
        "connected: as of its last report; a filter or share the producer did not count)",
        labels=labels,
    )
    connected = GaugeMetricFamily(
        "streamq_consumer_connected",
        "1 if the consumer is subscribed now; 0: its figures are as of its last report "
        "(streamq_consumer_last_report_seconds), and it may have applied more since",
        labels=labels,
    )
    registered = GaugeMetricFamily(
        "streamq_consumer_registered", "1 if retention keeps records for it", labels=labels
    )
    lost = CounterMetricFamily(
        "streamq_consumer_lost_records",
        "Records retention deleted before the consumer applied them",
        labels=labels,
    )
    reported = GaugeMetricFamily(
        "streamq_consumer_last_report_seconds",
        "When the consumer last reported its position (Unix time; 0: never)",
        labels=labels,
    )
    groups: dict[tuple[str, str], tuple[int, bool]] = {}
    for position in producer.consumer_lags():
        key = [position.consumer, position.stream]
        applied.add_metric(key, position.applied)
        lag.add_metric(key, position.lag)
        exact.add_metric(key, int(position.exact))
        connected.add_metric(key, int(position.connected))
        registered.add_metric(key, int(position.registered))
        lost.add_metric(key, position.lost)
        reported.add_metric(key, position.updated_at)
        if (shared := split_share_name(position.consumer)) is not None:
            group = (shared[0], position.stream)
            total, known = groups.get(group, (0, True))
            groups[group] = (total + position.lag, known and position.exact)
    labels = ["group", "stream"]
    owed = GaugeMetricFamily(
        "streamq_group_lag",
        "Records a group (or workers split into shares) has not yet applied: the sum of "
        "its shares' lags, as streamq status --group sums them",
        labels=labels,
    )
    owed_exact = GaugeMetricFamily(
        "streamq_group_lag_exact",
        "1 if every share's streamq_consumer_lag is exact; 0: streamq_group_lag is an upper bound",
        labels=labels,
    )
    for (group_name, stream), (total, known) in sorted(groups.items()):
        owed.add_metric([group_name, stream], total)
        owed_exact.add_metric([group_name, stream], int(known))
    yield from (applied, lag, exact, connected, registered, lost, reported, owed, owed_exact)


def _open_transactions(producer: ProducerState) -> Iterator[Metric]:
    """Transactions that published and have not ended (none without a numberer)."""
    if producer.numberer is None:
        return
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


def _capture(producer: ProducerState) -> Iterator[Metric]:
    """Tables captured from the WAL (none without ``capture=``)."""
    capture = producer.capture
    if capture is None:
        return
    yield CounterMetricFamily(
        "streamq_capture_changes", "Row changes captured and published", capture.captured
    )
    yield GaugeMetricFamily(
        "streamq_capture_lsn",
        "Every transaction committed up to this LSN is published",
        capture.lsn,
    )
    yield GaugeMetricFamily(
        "streamq_capture_retained_wal_bytes",
        "WAL the capture's replication slot keeps PostgreSQL from recycling",
        capture.retained_bytes,
    )


def _traffic(server: Server) -> Iterator[Metric]:
    """What the producer's server sent, and its connections."""
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
