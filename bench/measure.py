"""The one rate pacer and the one latency recorder every workload uses.

Loads are paced on a fixed schedule and latencies are measured from each item's due
time, not from when it was sent: a stall delays everything due during it, and that shows
in the percentiles (no coordinated omission).
"""

from __future__ import annotations

import asyncio
import time
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from hdrh.histogram import HdrHistogram

HIGHEST_US = 600_000_000  # 10 min: anything slower is recorded as 10 min


class Pacer:
    """RATE items a second: item n (from 0) is due at ``start + n / rate``.

    ``clock`` is ``time.time`` (the default) when due times travel to another process,
    which reads the same wall clock; ``time.monotonic`` when they stay in one.
    """

    def __init__(
        self, rate: float, start: float | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        if rate <= 0:
            raise ValueError(f"a pacer needs a rate above 0, not {rate}")
        self.rate = rate
        self.clock = clock
        self.start = clock() if start is None else start
        self.taken = 0  # items handed out (sent, applied ...) so far
        self.per_second: Counter[int] = Counter()  # items taken, by second since start

    def due(self, n: int) -> float:
        """When item ``n`` is due."""
        return self.start + n / self.rate

    def owed(self) -> int:
        """Items due by now and not taken yet (0 or less: ahead of schedule)."""
        return int((self.clock() - self.start) * self.rate) + 1 - self.taken

    def take(self, count: int) -> list[float]:
        """Take the next ``count`` items; returns their due times."""
        dues = [self.due(self.taken + i) for i in range(count)]
        self.record(count)
        return dues

    def record(self, count: int) -> None:
        """``count`` more items done, counted in the current second."""
        self.taken += count
        self.per_second[int(self.clock() - self.start)] += count

    def wait(self) -> float:
        """Seconds until the next item is due (0: it is due)."""
        return max(0.0, self.due(self.taken) - self.clock())

    async def until_due(self, spin: bool = True) -> None:
        """In an event loop, toward the next item's due time. ``spin``: sleep to just
        before it (loop timers tick in milliseconds), then yield until it is due, for
        precise due times; else sleep until it is (up to a millisecond late: the next
        call takes what came due meanwhile), so that the process's CPU is its work."""
        delay = self.wait()
        if spin:
            delay = delay - 0.001 if delay > 0.002 else 0
        await asyncio.sleep(delay)

    def worst_second(self, seconds: float) -> int:
        """The fewest items taken in one whole second of the first ``seconds``."""
        return min((self.per_second[s] for s in range(int(seconds))), default=0)


class Latencies:
    """Latencies in microseconds (HdrHistogram, 3 significant digits), with their count.

    Recording keeps the raw figures (8 bytes each, in one array) and the histogram takes
    them in when it is read: its ``record_value`` is pure Python (about 1.5 µs a value), a
    cost the measured process would otherwise pay while it is measured. Kept as one flat
    array, not an object per arrival: millions of those made the process's garbage
    collector scan them all, again and again, in pauses that grew with the run (a
    fan-out consumer process's p99 went from 4 to 24 ms at 50 consumers).
    """

    def __init__(self) -> None:
        self._histogram = HdrHistogram(1, HIGHEST_US, 3)
        self._micros = array("q")  # latencies given in microseconds
        self.count = 0

    def record(self, dues: Sequence[float], at: float) -> None:
        """Items due at ``dues`` (seconds, the pacer's clock) that arrived at ``at``."""
        self._micros.extend([int((at - due) * 1e6) for due in dues])
        self.count += len(dues)

    def record_micros(self, micros: Iterable[int]) -> None:
        before = len(self._micros)
        self._micros.extend(micros)
        self.count += len(self._micros) - before

    @property
    def histogram(self) -> HdrHistogram:
        """Every latency recorded so far."""
        values: Counter[int] = Counter(self._micros)
        self._micros = array("q")
        for value, times in values.items():
            self._histogram.record_value(min(HIGHEST_US, max(1, value)), times)
        return self._histogram

    def figures(self) -> list[int]:
        """p50, p99, p99.9, max (microseconds) and the count: one DONE line's fields."""
        h = self.histogram
        return [
            *(int(h.get_value_at_percentile(p)) for p in (50, 99, 99.9)),
            int(h.get_max_value()),
            self.count,
        ]

    def encode(self) -> str:
        """The histogram as one word, for a child's DONE line (``merged`` reads it)."""
        return str(self.histogram.encode().decode())

    @classmethod
    def merged(cls, encoded: Iterable[str]) -> Latencies:
        """Several processes' histograms (``encode``) as one."""
        merged = cls()
        for text in encoded:
            merged._histogram.add(HdrHistogram.decode(text.encode()))
        merged.count = int(merged._histogram.get_total_count())
        return merged
