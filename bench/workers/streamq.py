"""streamq's processes of the workers workload (the package's docstring): ``worker DB INDEX
WORKERS RATE COUNT SECONDS`` publishing with ``streamq.publish``, and ``consumer ADDRESS OUT
SECONDS DRAIN``."""

from __future__ import annotations

import asyncio
import contextlib
import sys

import streamq
from streamq import _loop

from .common import STREAM, Expected, Receipts, main


async def consumer(address: str, out: str, seconds: float, drain: float) -> None:
    loop = asyncio.get_running_loop()
    arrival = asyncio.Event()
    expected = Expected(lambda: loop.call_soon_threadsafe(arrival.set))
    receipts = Receipts()
    async with streamq.Consumer(address, STREAM, start_seq=1) as consumer:

        async def receive_until_expected() -> None:
            async for batch in consumer:
                receipts.record([(r.seq, r.value) for r in batch])
                if expected.reached(len(receipts.received)):
                    return

        receipts.ready()
        receiving = asyncio.create_task(receive_until_expected())
        try:
            async with asyncio.timeout(seconds):
                await arrival.wait()
            if not expected.reached(len(receipts.received)):  # else all came before EXPECT
                with contextlib.suppress(TimeoutError):  # what is missing shows in the receipts
                    async with asyncio.timeout(drain):
                        await asyncio.wait([receiving])
        finally:
            receiving.cancel()
            await asyncio.wait([receiving])
        if not receiving.cancelled():
            receiving.result()  # its error, if it had one
    receipts.report(out)


if __name__ == "__main__":
    main(
        "streamq",
        sys.argv[1:],
        lambda args: _loop.run(consumer(args[0], args[1], float(args[2]), float(args[3]))),
    )
