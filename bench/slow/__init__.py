"""Workload 4, slow consumer: the consumer applies at 10 % of the production rate
(``run``; processes: ``streamq``, ``kafka``).

Producers commit on a fixed schedule and report the rate they achieved, overall and in
their worst second (``DONE RATE WORST``). Consumers apply exactly once into SQLite, held
to RATE records/s. Both are paced by ``bench.measure.Pacer``.
"""

from __future__ import annotations

from ..common import say
from ..measure import Pacer

VALUE = b"s" * 100


def report(pacer: Pacer, seconds: float) -> None:
    """A producer's DONE line: its commit rate overall and in its worst second."""
    say("DONE", pacer.taken / seconds, pacer.worst_second(seconds))
