"""streamq's side of the groups workload.

``producer DB RATE``: a Producer serving a new database; prints ``READY ADDRESS``, then
commits RATE records a second (keys in turn over ``KEYS``, each record carrying its due
time) until ``STOP`` (or ``MAX_SECONDS``), prints ``DONE HEAD`` and serves until stdin
closes.

``member ADDRESS DB SHARES``: one member of group ``GROUP`` (``GroupConsumer``, its
default poll_interval and lease_timeout), applying each batch as one ``applied`` row per
record into the SQLite database DB, under its lease. Prints ``JOINED MEMBER``, then
``HELD SHARES`` whenever the shares it holds change and ``LOST COUNT`` whenever a share
is taken from it while it lives; applies until ``STOP`` (or ``MAX_SECONDS``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Callable

import streamq
from streamq import _loop
from streamq.groups.group_consumer import GroupConsumer

from ..common import say, wait_line
from ..measure import Pacer
from .common import GROUP, INSERT, STREAM, due_of, key_of, value_of

MAX_SECONDS = 1800.0  # no process of a run lives longer
TICK = 0.002  # s between the producer's commits: each commits every record due by then


def _publish(tx: streamq.BlockingTransaction, records: list[tuple[bytes, bytes]]) -> None:
    for key, value in records:
        tx.publish(STREAM, value, key=key)


async def producer(db: str, rate: float) -> None:
    async with streamq.Producer(db, port=0) as served:
        await served.create_stream(STREAM)
        say("READY", served.address)
        stop = asyncio.ensure_future(asyncio.to_thread(wait_line, "STOP"))
        pacer = Pacer(rate)
        total = int(rate * MAX_SECONDS)
        while pacer.taken < total and not stop.done():
            count = min(total - pacer.taken, pacer.owed())
            if count > 0:
                first = pacer.taken + 1
                dues = pacer.take(count)
                records = [(key_of(n), value_of(n, due)) for n, due in enumerate(dues, first)]
                await served.run_in_transaction(_publish, records)
            await asyncio.sleep(TICK)
        say("DONE", served.head(STREAM))
        with contextlib.suppress(SystemExit):
            await stop  # STOP read, or stdin closed
        await asyncio.to_thread(sys.stdin.read)  # serves until the driver closes stdin


async def member(address: str, db: str, shares: int) -> None:
    pid = os.getpid()

    def record(tx: streamq.BlockingSQL, batch: streamq.Batch, share: int) -> None:
        now = time.time()
        rows = [(r.seq, r.key, share, pid, due_of(r.value), now) for r in batch]
        tx.executemany(INSERT, rows)

    async with GroupConsumer(
        address, STREAM, db=db, name=GROUP, shares=shares, reconnect_timeout=30
    ) as group:
        say("JOINED", group.member)
        reporting = asyncio.create_task(report(group))
        applying = asyncio.create_task(apply_all(group, record))
        stop = asyncio.ensure_future(asyncio.to_thread(wait_line, "STOP"))
        first = asyncio.FIRST_COMPLETED
        await asyncio.wait([applying, stop], timeout=MAX_SECONDS, return_when=first)
        for task in (applying, reporting):
            task.cancel()
        failed = applying.done() and not applying.cancelled() and applying.exception()
        await asyncio.gather(applying, reporting, return_exceptions=True)
        if failed:
            raise failed


Record = Callable[[streamq.BlockingSQL, streamq.Batch, int], None]


async def apply_all(group: GroupConsumer, record: Record) -> None:
    async for batch in group:
        assert batch.fence is not None  # a group's batch names its share
        with contextlib.suppress(streamq.LeaseLostError):  # the new holder applies it
            await group.apply(batch, record, batch.fence.share)


async def report(group: GroupConsumer) -> None:
    """``HELD`` and ``LOST`` lines whenever they change, looked at every 10 ms."""
    held: list[int] | None = None
    losses = 0
    while True:
        if group.held != held:
            held = group.held
            say("HELD", ",".join(map(str, held)))
        if group.losses != losses:
            losses = group.losses
            say("LOST", losses)
        await asyncio.sleep(0.01)


def main(argv: list[str]) -> None:
    role, *args = argv
    if role == "producer":
        _loop.run(producer(args[0], float(args[1])))
    elif role == "member":
        _loop.run(member(args[0], args[1], int(args[2])))
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
