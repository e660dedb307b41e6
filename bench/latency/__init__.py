"""Workload 2, latency: fixed publish rates; from each record's due time to its receipt
(``run``; processes: ``streamq``, ``kafka``).

Producers publish on a fixed schedule (``bench.measure.Pacer``): record n is due at
start + n / RATE and carries that due time. Consumers measure receipt minus due time, so
a stall delays every record due during it and shows in the percentiles (no coordinated
omission).
"""

from __future__ import annotations

import struct
import time

from ..measure import Latencies

RECORD_SIZE = 100
DUE = struct.Struct("<dq")  # due time (s since the epoch), record number
START_DELAY = 0.2  # s from GO to the first record's due time


def record_value(due: float, number: int) -> bytes:
    """A record of ``RECORD_SIZE`` bytes carrying its due time."""
    return DUE.pack(due, number).ljust(RECORD_SIZE, b".")


def schedule_start() -> float:
    """The wall-clock time the first record is due, once a producer is told GO."""
    return time.time() + START_DELAY


def record_receipt(latencies: Latencies, values: list[bytes], received: float) -> None:
    """Each value's latency from the due time it carries to ``received``."""
    latencies.record([DUE.unpack_from(value)[0] for value in values], received)
