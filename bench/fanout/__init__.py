"""Workload: fan-out, one producer serving N consumers that tail one stream (``run``;
processes: ``streamq``, ``nats``, ``kafka``).

A producer publishes records of 100 B on a fixed schedule, one publish each (``latency``'s
``Pacer``: each carries its due time and its number); N consumers, in several processes,
each receive every record. The serving process is pinned to one core with the producer,
the consumers to the other core(s):

- **streamq**: the producer's embedded server (``Producer``, the serving process is the
  producer's), or ``streamq serve`` beside a producer that does not serve
  (``Producer(serve=False)``: the serving process does nothing but serve);
  ``streamq.Consumer`` each.
- **NATS JetStream**: nats-server; an ordered push consumer each, on its own connection.
- **Kafka**: the broker's JVM; a topic of one partition, a consumer each in a group of
  its own, reading the partition from its start.

Per system, N and rate: the serving process's CPU over the publishing window, the rate
the producer reached and its publish latency (call to commit or acknowledgement), p50 and
p99 from due time to receipt over every consumer's every record, and how many records
reached their consumers in order, against every record to every consumer.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable

from ..common import say, wait_line
from ..latency import DUE
from ..measure import Latencies


def cores() -> tuple[set[int], set[int]]:
    """The serving side's cores (the server and the producer) and the consumers': the
    first core and the others, where there are two or more; the one core for both."""
    available = sorted(os.sched_getaffinity(0))
    if len(available) < 2:
        return set(available), set(available)
    return {available[0]}, set(available[1:])


class Tally:
    """What one process's consumers received: each consumer's records counted in order
    (record n after record n - 1: a record missed, repeated or out of order is counted
    apart, never as delivered) and every receipt's latency. Safe from several threads
    (the Kafka consumers run one each)."""

    def __init__(self, consumers: int, total: int, by_second: bool = False) -> None:
        self.total = total
        # With ``by_second``, the latencies also by the wall-clock second each record was
        # due in: what happened to them while something else did (``stopped``).
        self.by_second: dict[int, Latencies] | None = {} if by_second else None
        self.next = [0] * consumers  # per consumer, the record number it should get next
        self.delivered = self.skipped = self.repeated = 0
        self.complete = 0  # consumers that have their last record
        self.latencies = Latencies()
        self._lock = threading.Lock()

    def receive(self, consumer: int, values: list[bytes], at: float) -> bool:
        """``values`` received by ``consumer`` at ``at``; True once it has the last record."""
        with self._lock:
            expected, dues = self.next[consumer], []
            for value in values:
                due, number = DUE.unpack_from(value)
                dues.append(due)
                if number < expected:
                    self.repeated += 1
                    continue
                self.skipped += number - expected
                self.delivered += 1
                expected = number + 1
            self.latencies.record(dues, at)
            if self.by_second is not None:
                for second in {int(dues[0]), int(dues[-1])}:
                    due = [d for d in dues if int(d) == second]
                    self.by_second.setdefault(second, Latencies()).record(due, at)
            finished = self.next[consumer] < self.total <= expected
            self.next[consumer] = expected
            self.complete += finished
            return expected >= self.total

    @property
    def all_complete(self) -> bool:
        return self.complete == len(self.next)

    def say_done(self) -> None:
        """The DONE line: delivered, skipped, repeated and the latencies' histogram; with
        ``by_second``, then each second's as SECOND:HISTOGRAM, comma-separated."""
        with self._lock:
            fields = [self.delivered, self.skipped, self.repeated, self.latencies.encode()]
            if self.by_second is not None:
                seconds = sorted(self.by_second.items())
                fields.append(",".join(f"{s}:{h.encode()}" for s, h in seconds))
            say("DONE", *fields)


def on_stop(callback: Callable[[], object]) -> None:
    """``callback()``, on a thread of its own, once the parent says STOP (or goes away):
    consumers still short of records then report what they have."""

    def wait() -> None:
        with contextlib.suppress(SystemExit):  # the parent went away
            wait_line("STOP")
        callback()

    threading.Thread(target=wait, name="stop", daemon=True).start()
