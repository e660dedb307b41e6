"""The shares workload's processes (streamq alone: the workload measures how its shares scale).

``producer DB COUNT KEYS``: commits COUNT records over KEYS keys into a new producer
database, serves it, prints ``READY ADDRESS`` and serves until stdin closes.

``worker ADDRESS DB_URL INDEX SHARES COUNT APPLY_MS``: one worker of SHARES (1: the
whole stream, no share), applying into the PostgreSQL database DB_URL exactly once: per
batch, it waits APPLY_MS per record (the deliberately slow part, e.g. a call to another
service) and inserts one ``effects`` row per record, in one transaction with its
position. Prints ``READY``, waits for ``GO``, applies until its position reaches COUNT
and prints ``DONE START END RECORDS``: wall-clock seconds of GO and of the commit of its
last batch that held records, and how many records it applied.

``member ADDRESS DB_URL SHARES APPLY_MS``: the same apply by a member of a consumer group
(``GroupConsumer``, shares=SHARES) instead of a hand-given share; its rows' ``worker`` is
the share the batch came from. Prints ``HELD SHARES`` whenever they change (applying
nothing before ``GO``), applies from ``GO`` until ``STOP``, then prints ``DONE START END
RECORDS`` as a worker does.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import streamq
from streamq import _loop

from ..common import say, wait_line

STREAM = "jobs"
VALUE = b"j" * 100
MEMBER_SECONDS = 600.0  # a group member applies for at most this long
EFFECTS = (
    "CREATE TABLE IF NOT EXISTS effects (n bigserial PRIMARY KEY, seq bigint NOT NULL UNIQUE, "
    "key bytea, worker int NOT NULL)"
)


def key_of(n: int, keys: int) -> bytes:
    return b"customer-%d" % (n % keys)


async def producer(db: str, count: int, keys: int) -> None:
    async with streamq.Producer(db, port=0) as served:
        await served.create_stream(STREAM)
        for first in range(1, count + 1, 1000):
            async with served.transaction() as tx:
                for n in range(first, min(count + 1, first + 1000)):
                    await tx.publish(STREAM, VALUE, key=key_of(n, keys))
        say("READY", served.address)
        await asyncio.to_thread(sys.stdin.read)  # until the driver closes stdin


def apply(tx: Any, batch: streamq.Batch, worker: int, apply_ms: float) -> None:
    time.sleep(apply_ms * len(batch) / 1000)
    tx.executemany(
        "INSERT INTO effects (seq, key, worker) VALUES (%s, %s, %s)",
        [(r.seq, r.key, worker) for r in batch],
    )


async def worker(
    address: str, db: str, index: int, shares: int, count: int, apply_ms: float
) -> None:
    share = (index, shares) if shares > 1 else None
    async with streamq.Consumer(address, STREAM, db=db, name="workers", share=share) as consumer:
        say("READY")
        await asyncio.to_thread(wait_line, "GO")
        start = end = time.time()
        records = 0
        while consumer.applied < count:
            batch = await anext(consumer)
            await consumer.apply(batch, apply, index, apply_ms)
            if len(batch):
                records += len(batch)
                end = time.time()
        say("DONE", start, end, records)


async def member(address: str, db: str, shares: int, apply_ms: float) -> None:
    from ..groups.streamq import report

    async with streamq.GroupConsumer(
        address, STREAM, db=db, name="workers", shares=shares
    ) as group:
        reporting = asyncio.create_task(report(group))
        await asyncio.to_thread(wait_line, "GO")
        start = end = time.time()
        records = 0
        stop = asyncio.ensure_future(asyncio.to_thread(wait_line, "STOP"))
        async with asyncio.timeout(MEMBER_SECONDS):
            while True:
                receiving = asyncio.ensure_future(anext(group))
                await asyncio.wait([receiving, stop], return_when=asyncio.FIRST_COMPLETED)
                if not receiving.done():
                    receiving.cancel()  # the group keeps the batch being read: nothing lost
                    break
                batch = receiving.result()
                assert batch.fence is not None  # a group's batch names its share
                try:
                    await group.apply(batch, apply, batch.fence.share, apply_ms)
                except streamq.LeaseLostError:
                    continue  # the share moved: its new holder applies the batch
                if len(batch):
                    records += len(batch)
                    end = time.time()
        reporting.cancel()
        say("DONE", start, end, records)


def main(argv: list[str]) -> None:
    role, *args = argv
    if role == "producer":
        _loop.run(producer(args[0], int(args[1]), int(args[2])))
    elif role == "worker":
        address, db, index, shares, count, apply_ms = args
        _loop.run(worker(address, db, int(index), int(shares), int(count), float(apply_ms)))
    elif role == "member":
        address, db, shares, apply_ms = args
        _loop.run(member(address, db, int(shares), float(apply_ms)))
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
