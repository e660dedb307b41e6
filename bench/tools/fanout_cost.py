"""What each consumer at the head costs the producer's server, per commit: ``python -m
bench.tools.fanout_cost [--consumers 0,100,300] [--commits N] [--rate R] [--repeats N]``.

A producer, its server embedded and pinned to one core, publishes one record of 100 B
per transaction at ``rate`` transactions/s; N readers tail the stream from another
process on the other core, each a bare subscription that reads and discards (no
consumer's own work, so the figure is the server's alone). For each N: the producer
process's CPU per commit; against N = 0, the cost of each extra reader per commit.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from streamq import Producer, _loop
from streamq.protocol import PROTOCOL_VERSION, ClientConnection, ClientHello, Subscribe

from ..common import Child, pin, say, wait_line

STREAM = "fanout"
VALUE = b"v" * 100


async def producer(db: str, commits: int, rate: float) -> None:
    pin(os.getpid(), [0])
    async with Producer(db, port=0) as served:
        await served.create_stream(STREAM)
        say("READY", served.address)
        await asyncio.to_thread(wait_line, "GO")
        cpu, began = time.process_time(), time.perf_counter()
        for n in range(commits):
            await served.publish(STREAM, VALUE)
            delay = began + (n + 1) / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        say("DONE", (time.process_time() - cpu) / commits * 1e6)
        await asyncio.to_thread(wait_line, "STOP")


async def readers(address: str, count: int) -> None:
    pin(os.getpid(), [1 % (os.cpu_count() or 1)])
    host, port = address.rsplit(":", 1)

    async def read(i: int, ready: asyncio.Event) -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        conn = ClientConnection()
        writer.write(conn.send(ClientHello(PROTOCOL_VERSION, f"reader-{i}")))
        writer.write(conn.send(Subscribe(STREAM, 1, f"reader-{i}", None)))
        ready.set()
        while await reader.read(1 << 16):
            pass

    events = [asyncio.Event() for _ in range(count)]
    tasks = [asyncio.create_task(read(i, e)) for i, e in enumerate(events)]
    for event in events:
        await event.wait()
    say("READY")
    await asyncio.to_thread(wait_line, "STOP")
    for task in tasks:
        task.cancel()


def measure(consumers: int, commits: int, rate: float) -> float:
    """The producer's CPU per commit (µs) with ``consumers`` readers at the head."""
    program = "bench.tools.fanout_cost"
    with tempfile.TemporaryDirectory() as folder:
        with Child(program, "producer", Path(folder) / "p.db", commits, rate) as served:
            (address,) = served.expect("READY")
            with Child(program, "readers", address, consumers) as reading:
                reading.expect("READY")
                time.sleep(1.0)  # every subscription caught up with the empty stream
                served.send("GO")
                (per_commit,) = served.expect("DONE")
                served.send("STOP")
                reading.send("STOP")
        return float(per_commit)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tools.fanout_cost", description=__doc__)
    parser.add_argument("--consumers", default="0,100,300")
    parser.add_argument("--commits", type=int, default=3000)
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.consumers.split(",")]
    figures: dict[int, list[float]] = {n: [] for n in counts}
    for _ in range(args.repeats):
        for n in counts:
            figures[n].append(measure(n, args.commits, args.rate))
    base = statistics.median(figures[counts[0]])
    for n in counts:
        median = statistics.median(figures[n])
        extra = "" if n == counts[0] else f"  {(median - base) / (n - counts[0]):.2f} µs a reader"
        runs = ", ".join(f"{f:.1f}" for f in figures[n])
        print(f"{n:>5} readers: {median:8.1f} µs CPU a commit ({runs}){extra}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("producer", "readers"):
        role, *rest = sys.argv[1:]
        if role == "producer":
            _loop.run(producer(rest[0], int(rest[1]), float(rest[2])))
        else:
            _loop.run(readers(rest[0], int(rest[1])))
    else:
        raise SystemExit(main())
