"""Prometheus metrics of consumers, and the endpoint that serves them beside a
producer's (``producer.metrics``), read from live state at scrape time.

Custom collectors, not counters updated as records flow: publishing, pushing and
applying keep only the plain integers they already had (heads, positions, per-stream
traffic, a consumer's counts), and a scrape turns them into metrics. prometheus-client
serves them from its own thread, on loopback unless told otherwise; everything read
here is copied first (``list(...)``), so a scrape never races the event loop's changes.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric


class ConsumerState(Protocol):
    """What a consumer's metrics read (a ``Consumer``): ``_CONSUMER_METRICS``' attributes
    besides these (read by name)."""

    @property
    def name(self) -> str: ...
    @property
    def stream(self) -> str: ...
    @property
    def address(self) -> str: ...
    @property
    def producer_id(self) -> str | None: ...


class GroupState(Protocol):
    """What a group member's metrics read (a ``GroupConsumer``)."""

    @property
    def name(self) -> str: ...
    @property
    def stream(self) -> str: ...
    @property
    def member(self) -> int: ...
    @property
    def shares(self) -> int | None: ...
    @property
    def held(self) -> list[int]: ...
    @property
    def takes(self) -> int: ...
    @property
    def losses(self) -> int: ...
    @property
    def taken_at(self) -> dict[int, float]: ...


@runtime_checkable
class ServesMetrics(Protocol):
    """A producer with a metrics endpoint, where consumers may report theirs."""

    @property
    def consumer_collector(self) -> ConsumerCollector | None: ...


# A consumer's own view, one sample per consumer: (name, help, the consumer's attribute
# read, a counter if True).
_CONSUMER_METRICS = (
    ("streamq_consumer_applied_seq", "Last seq this consumer committed", "applied", False),
    (
        "streamq_consumer_seen_lag",
        "The producer's head as last reported to this consumer, minus applied",
        "lag",
        False,
    ),
    (
        "streamq_consumer_records_applied",
        "Records applied in their batch (parked ones not counted)",
        "records_applied",
        True,
    ),
    ("streamq_consumer_batches_applied", "Batches committed", "batches_applied", True),
    (
        "streamq_consumer_records_parked",
        "Records parked in streamq_dead_letters (DeadLetter), committed",
        "parked",
        True,
    ),
    ("streamq_consumer_batches_retried", "Failed batches applied again", "retried", True),
    (
        "streamq_consumer_records_reapplied",
        "Parked records re-applied after streamq dead-letters retry",
        "reapplied",
        True,
    ),
    ("streamq_consumer_reconnects", "Connections to the producer made again", "reconnects", True),
)
_CONSUMER_LABELS = ["consumer", "stream", "address"]


class ConsumerCollector(Collector):
    """Prometheus metrics of consumers of this process, each as it sees itself: position,
    counts, lag, reconnects, read when scraped.

    ``add`` and ``remove`` say which; a ``Consumer`` given ``metrics_port=`` or
    ``metrics=`` adds itself at start and removes itself at close. To serve them with an
    application's own metrics, register one in its registry
    (``prometheus_client.REGISTRY.register(collector)``) and give it as
    ``Consumer(metrics=collector)``. Labelled by consumer name, stream and producer
    address: a ``FanInConsumer``'s consumers share the first two.
    """

    def __init__(self) -> None:
        # Replaced, never changed in place: a scrape's thread reads one list or the other.
        self._consumers: list[ConsumerState] = []
        self._groups: list[GroupState] = []

    def add_group(self, group: GroupState) -> None:
        """Export a group member's membership: the split, shares held, takes and losses
        (its shares' consumers are added as they are taken)."""
        if all(g is not group for g in self._groups):
            self._groups = [*self._groups, group]

    def remove_group(self, group: GroupState) -> None:
        self._groups = [g for g in self._groups if g is not group]

    def add(self, consumer: ConsumerState) -> None:
        """Export ``consumer``'s metrics (once, however often added)."""
        if all(c is not consumer for c in self._consumers):
            self._consumers = [*self._consumers, consumer]

    def remove(self, consumer: ConsumerState) -> None:
        """Stop exporting ``consumer``'s metrics (nothing if it was not added)."""
        self._consumers = [c for c in self._consumers if c is not consumer]

    def collect(self) -> Iterator[Metric]:
        yield from self._collect_groups()
        consumers = self._consumers
        if not consumers:
            return  # a producer's endpoint without consumers shows no empty families
        info = GaugeMetricFamily(
            "streamq_consumer_info",
            "The producer this consumer reads (id: empty until it connected)",
            labels=[*_CONSUMER_LABELS, "producer_id"],
        )
        for c in consumers:
            info.add_metric([c.name, c.stream, c.address, c.producer_id or ""], 1)
        yield info
        for name, text, attribute, counter in _CONSUMER_METRICS:
            family = (CounterMetricFamily if counter else GaugeMetricFamily)(
                name, text, labels=_CONSUMER_LABELS
            )
            for c in consumers:
                family.add_metric([c.name, c.stream, c.address], getattr(c, attribute))
            yield family

    def _collect_groups(self) -> Iterator[Metric]:
        groups = self._groups
        if not groups:
            return
        labels = ["group", "stream", "member"]
        families = (
            (GaugeMetricFamily, "streamq_group_shares", "The group's split into shares"),
            (GaugeMetricFamily, "streamq_group_shares_held", "Shares this member holds"),
            (CounterMetricFamily, "streamq_group_takes", "Shares this member took"),
            (CounterMetricFamily, "streamq_group_losses",
             "Shares taken from this member by others (it was seen dead or stalled)"),
        )  # fmt: skip
        values = [(g, (g.shares or 0, len(g.held), g.takes, g.losses)) for g in groups]
        for i, (kind, name, text) in enumerate(families):
            family = kind(name, text, labels=labels)
            for g, numbers in values:
                family.add_metric([g.name, g.stream, str(g.member)], numbers[i])
            yield family
        taken = GaugeMetricFamily(
            "streamq_group_share_taken_seconds",
            "When this member took the share's lease (Unix time): its age, as streamq "
            "groups shows it",
            labels=[*labels, "share"],
        )
        for g in groups:
            for share, at in sorted(g.taken_at.items()):
                taken.add_metric([g.name, g.stream, str(g.member), str(share)], at)
        yield taken


class MetricsServer:
    """``/metrics`` over HTTP, in a thread of prometheus-client's: one producer's metrics
    (its ``producer.metrics.ProducerCollector``; None: none), and those of the consumers
    added to ``consumers``."""

    def __init__(
        self,
        host: str,
        port: int,
        consumers: ConsumerCollector | None = None,
        producer: Collector | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        if producer is not None:
            self.registry.register(producer)
        self.consumers = ConsumerCollector() if consumers is None else consumers
        self.registry.register(self.consumers)
        try:
            self._httpd, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:  # a host that does not resolve, a port taken: say which
            why = os.strerror(exc.errno) if exc.errno and exc.errno > 0 else exc.strerror
            raise OSError(exc.errno, f"cannot serve metrics on {host}:{port}: {why}") from exc
        bound_host, bound_port = self._httpd.server_address[:2]
        host_text = str(bound_host)
        self.address = (
            f"[{host_text}]:{bound_port}" if ":" in host_text else f"{host_text}:{bound_port}"
        )

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


class MetricsEndpoint:
    """Where a consumer, a fan-in consumer or a group member reports its metrics:
    ``metrics_port`` (an endpoint of its own, on ``metrics_host``) or ``metrics=`` (a
    producer's endpoint, or a collector), or nowhere. ``collector`` is the collector its
    consumers add themselves to: made at once for an endpoint of its own (so that inner
    consumers can be given it as their ``metrics=``), found at ``open`` otherwise."""

    def __init__(
        self,
        port: int | None,
        host: str,
        target: ServesMetrics | ConsumerCollector | None,
    ) -> None:
        if port is not None and target is not None:
            raise ValueError(
                "give metrics_port= (an endpoint of its own) or metrics= (a producer's "
                "endpoint, or a collector), not both"
            )
        self._port, self._host, self._target = port, host, target
        self.collector = None if port is None else ConsumerCollector()
        self._server: MetricsServer | None = None

    def open(self) -> ConsumerCollector | None:
        """Serve the endpoint of its own, or find the target's collector."""
        if self._port is not None:
            self._server = MetricsServer(self._host, self._port, self.collector)
        elif self._target is not None:
            self.collector = consumers_of(self._target)
        return self.collector

    @property
    def address(self) -> str:
        """``host:port`` of the endpoint of its own (``/metrics``)."""
        if self._server is None:
            raise RuntimeError("this one serves no metrics of its own (metrics_port=None)")
        return self._server.address

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            await asyncio.to_thread(server.close)  # waits for its serving thread


def consumers_of(target: ServesMetrics | ConsumerCollector) -> ConsumerCollector:
    """Where ``Consumer(metrics=target)`` reports: ``target`` itself, or the consumers of a
    producer's endpoint (its ``metrics_port``), served beside the producer's metrics."""
    if isinstance(target, ConsumerCollector):
        return target
    if not isinstance(target, ServesMetrics):
        raise TypeError(
            "metrics= takes a started streamq.Producer that has a metrics_port, or a "
            f"streamq.ConsumerCollector, not {target!r} (metrics_port= serves the "
            "consumer's own endpoint)"
        )
    collector = target.consumer_collector
    if collector is None:
        raise ValueError(
            "metrics=producer: that producer serves no metrics (no metrics_port=, or not "
            "started yet); give it metrics_port=, or give the consumer a metrics_port= of its own"
        )
    return collector
