"""Many producers served by one process, as a host runs them: ``python -m bench.spark.host
DB...`` serves each database with a ``Producer`` on one event loop and prints, for each,
``serving producer ID on HOST:PORT`` (as ``streamq serve`` does); SIGTERM closes them.

The Spark workload's fleets at hundreds of producers use it: a process per producer
would measure 256 Python processes crowding the cores, and the kernel's 128 inotify
instances per user, more than the source.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys

import streamq
from streamq import _loop


async def serve(paths: list[str]) -> None:
    async with contextlib.AsyncExitStack() as stack:
        for path in paths:
            producer = await stack.enter_async_context(streamq.Producer(path, port=0))
            print(f"serving producer {producer.producer_id} on {producer.address}", flush=True)
        stopped = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopped.set)
        await stopped.wait()


def main(paths: list[str]) -> int:
    _loop.run(serve(paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
