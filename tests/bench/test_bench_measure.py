"""The benchmarks' one latency recorder (bench/measure.py): what it reports is what was
recorded, however the figures came in, and it survives the trip between processes."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from bench.measure import HIGHEST_US, Latencies


def at_percentile(values: list[int], percentile: float) -> int:
    """The value HdrHistogram reports at ``percentile`` (its rank: rounded, at least 1)."""
    rank = max(1, int(percentile * len(values) / 100 + 0.5))
    return sorted(values)[rank - 1]


def close(reported: int, exact: int) -> bool:
    """HdrHistogram with 3 significant digits: within 0.1 % (and one unit)."""
    return abs(reported - exact) <= exact / 1000 + 1


@given(st.lists(st.integers(1, 10_000_000), min_size=1, max_size=500), st.randoms())
def test_figures_are_those_recorded(micros: list[int], rng: random.Random) -> None:
    latencies = Latencies()
    at = 1_764_000_000.0  # seconds, as a pacer's clock gives them
    half = len(micros) // 2
    # Half as due times and an arrival, half as microseconds, in calls of any size.
    dues = [at - m / 1e6 for m in micros[:half]]
    while dues:
        cut = rng.randint(1, len(dues))
        latencies.record(dues[:cut], at)
        dues = dues[cut:]
    latencies.record_micros(iter(micros[half:]))
    p50, p99, p999, highest, count = latencies.figures()
    assert count == len(micros)
    assert close(p50, at_percentile(micros, 50))
    assert close(p99, at_percentile(micros, 99))
    assert close(p999, at_percentile(micros, 99.9))
    assert close(highest, max(micros))


def test_recording_after_reading_adds_to_what_was_read() -> None:
    latencies = Latencies()
    latencies.record_micros([100, 200])
    assert latencies.figures()[3:] == [200, 2]
    latencies.record([9.0], 10.0)  # one second late
    p50, _, _, highest, count = latencies.figures()
    assert (p50, count) == (200, 3)
    assert close(highest, 1_000_000)


def test_out_of_range_values_are_clamped() -> None:
    latencies = Latencies()
    latencies.record([11.0], 10.0)  # arrived before it was due (clocks): 1 µs
    latencies.record_micros([HIGHEST_US * 2])
    p50, _, _, highest, count = latencies.figures()
    assert (p50, count) == (1, 2)
    assert close(highest, HIGHEST_US)


def test_merged_from_several_processes() -> None:
    parts = [Latencies() for _ in range(3)]
    for i, part in enumerate(parts):
        part.record_micros(range(1 + i * 1000, 1001 + i * 1000))
    merged = Latencies.merged(part.encode() for part in parts)
    p50, _, _, highest, count = merged.figures()
    assert count == 3000
    assert close(p50, 1500)
    assert close(highest, 3000)
