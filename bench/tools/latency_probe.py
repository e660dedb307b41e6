"""Where streamq's latency goes: ``python -m bench.tools.latency_probe [--rate 10000]
[--seconds 10]``.

The latency workload's producer (``bench.latency.streamq.publish_paced``), run in this
process and timed: how late each commit starts after its first record is due, and how
long ``run_in_transaction`` takes; the consumer process reports receipt latency as in the
workload. What lies between a commit's end and the receipt is the push path and
scheduling.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

import streamq
from streamq import _loop
from streamq.sql import Durability

from ..common import Child, console
from ..latency import schedule_start
from ..latency.streamq import STREAM, publish_paced
from ..measure import Latencies, Pacer


def _percentiles(figures: list[int]) -> str:
    return " / ".join(f"{v:,}" for v in figures[:4])


async def probe(db: str, rate: int, seconds: float, durability: Durability) -> None:
    lateness, commits = Latencies(), Latencies()

    def timed(dues: list[float], late: float, took: float) -> None:
        lateness.record_micros([int(late * 1e6)])
        commits.record_micros([int(took * 1e6)])

    total = int(rate * seconds)
    async with streamq.Producer(db, port=0, durability=durability) as producer:
        await producer.create_stream(STREAM)
        with Child("bench.latency.streamq", "consumer", producer.address, total) as consumer:
            await asyncio.to_thread(consumer.expect, "READY")
            await publish_paced(producer, Pacer(rate, schedule_start()), total, timed)
            receipt = await asyncio.to_thread(consumer.expect, "DONE", 120.0)
    console.print(f"[bold]{rate:,}/s {durability}[/], microseconds p50 / p99 / p99.9 / max")
    console.print(f"  commit starts late by  {_percentiles(lateness.figures())}")
    console.print(f"  commit takes           {_percentiles(commits.figures())}")
    console.print(f"  receipt latency        {_percentiles([int(v) for v in receipt])}")


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.tools.latency_probe", description=__doc__
    )
    parser.add_argument("--rate", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    modes: tuple[Durability, ...] = ("normal", "full")
    for durability in modes:
        with tempfile.TemporaryDirectory() as folder:
            _loop.run(probe(str(Path(folder) / "p.db"), args.rate, args.seconds, durability))


if __name__ == "__main__":
    main()
