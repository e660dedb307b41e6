"""Where streamq's latency goes: ``python -m bench.latency_probe [--rate 10000] [--seconds 10]``.

The latency workload's producer, run in this process and timed: how late each commit
starts after its record is due, and how long ``run_in_transaction`` takes; the consumer
process reports receipt latency as in the workload. What lies between a commit's end
and the receipt is the push path and scheduling.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from hdrh.histogram import HdrHistogram

import streamq
from streamq import _loop
from streamq.storage import Durability

from . import latency_programs
from .common import Child, console

STREAM = "latency"


def _percentiles(histogram: HdrHistogram) -> str:
    values = [histogram.get_value_at_percentile(p) for p in (50, 99, 99.9)]
    return " / ".join(f"{v:,}" for v in [*values, histogram.get_max_value()])


async def probe(db: str, rate: int, seconds: float, durability: Durability) -> None:
    lateness, commits = HdrHistogram(1, 60_000_000, 3), HdrHistogram(1, 60_000_000, 3)
    total = int(rate * seconds)
    async with streamq.Producer(db, port=0, durability=durability) as producer:
        await producer.create_stream(STREAM)
        programs = "bench.latency_programs"
        with Child(programs, "sq-consumer", producer.address, total) as consumer:
            await asyncio.to_thread(consumer.expect, "READY")
            start, sent = time.time() + 0.2, 0
            while sent < total:
                due_now = min(total, int((time.time() - start) * rate) + 1)
                if due_now <= sent:
                    delay = start + sent / rate - time.time()
                    await asyncio.sleep(delay - 0.001 if delay > 0.002 else 0)
                    continue
                due = [start + n / rate for n in range(sent, due_now)]
                values = [latency_programs._value(d, n) for n, d in enumerate(due, sent)]
                began = time.perf_counter()
                lateness.record_value(max(1, int((time.time() - due[0]) * 1e6)))
                await producer.run_in_transaction(latency_programs._publish, values)
                commits.record_value(max(1, int((time.perf_counter() - began) * 1e6)))
                sent = due_now
            receipt = await asyncio.to_thread(consumer.expect, "DONE", 120.0)
    console.print(f"[bold]{rate:,}/s {durability}[/], microseconds p50 / p99 / p99.9 / max")
    console.print(f"  commit starts late by  {_percentiles(lateness)}")
    console.print(f"  commit takes           {_percentiles(commits)}")
    console.print(f"  receipt latency        {' / '.join(f'{int(v):,}' for v in receipt[:4])}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.latency_probe", description=__doc__)
    parser.add_argument("--rate", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    modes: tuple[Durability, ...] = ("normal", "full")
    for durability in modes:
        with tempfile.TemporaryDirectory() as folder:
            _loop.run(probe(str(Path(folder) / "p.db"), args.rate, args.seconds, durability))


if __name__ == "__main__":
    main()
