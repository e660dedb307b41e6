"""streamq's processes of the transfer workload (the package's docstring): ``producer DB
PORT TOTAL RATE SEED [HANDLERS DURABILITY]`` and ``consumer ADDRESS DB TARGET``."""

from __future__ import annotations

import asyncio
import logging
import random
import sys
import time
from collections.abc import Callable
from typing import Any, cast

import streamq
from streamq import _loop
from streamq.sql import Durability

from ..common import say
from ..measure import Latencies
from .common import (
    ACCOUNTS,
    CONNECT_TIMEOUT,
    CONSUMER_SCHEMA,
    CREDIT,
    DEBIT,
    DEPOSIT,
    JOURNAL,
    LEDGER,
    OPENING_BALANCE,
    PRODUCER_SCHEMA,
    RECORD_CREDIT,
    STREAM,
    Control,
    Schedule,
    Transfer,
    debits,
    make_transfers,
    payloads,
    setup_consumer_db,
)


def transfer(
    tx: streamq.BlockingTransaction, batch: list[Transfer], dues: list[float] | None
) -> None:
    """Debit, journal and deposit: one commit, run on the producer's writer thread."""
    tx.executemany(DEBIT, debits(batch))
    tx.executemany(JOURNAL, batch)
    tx.publish_many(STREAM, payloads(batch, dues))


async def producer(
    db: str,
    port: int,
    total: int,
    rate: float,
    seed: int,
    handlers: int = 1,
    durability: Durability = "normal",
) -> None:
    control = Control()
    rng = random.Random(seed)
    async with streamq.Producer(db, port=port, durability=durability) as producer:
        async with producer.transaction() as tx:
            for statement in PRODUCER_SCHEMA:
                await tx.execute(statement)
            await tx.executemany(
                "INSERT OR IGNORE INTO accounts (id, balance) VALUES (?, ?)",
                [(i, OPENING_BALANCE) for i in range(ACCOUNTS)],
            )
            cursor = await tx.execute("SELECT COALESCE(MAX(transfer_id), 0) FROM transfers")
            row = await cursor.fetchone()
            assert row is not None
            last = int(row[0])
        await producer.create_stream(STREAM)
        say("READY", producer.address)
        await asyncio.to_thread(control.wait_go)
        say("START", time.time())
        if handlers > 1:
            await request_handlers(
                producer, control, make_transfers(rng, last + 1, total - last), handlers
            )
            last = total
        schedule = Schedule(rate, rng)
        while last < total and not control.stop.is_set():
            count, dues, wait = schedule.take(total - last)
            if count == 0:
                await asyncio.sleep(wait)
                continue
            transfers = make_transfers(rng, last + 1, count)
            await producer.run_in_transaction(transfer, transfers, dues)
            last += count
            control.worst_moment()  # committed; not yet pushed to the ledger
            await asyncio.sleep(0)  # let the server push between commits
        say("DONE", time.time())
        while not control.stop.is_set():  # keep serving until told to stop
            await asyncio.sleep(0.05)


async def request_handlers(
    producer: streamq.Producer, control: Control, transfers: list[Transfer], handlers: int
) -> None:
    """``handlers`` concurrent request handlers of a web service, each committing one
    transfer per transaction, as fast as they can: the producer commits them in groups."""
    requests = iter(transfers)

    async def handler() -> None:
        for request in requests:  # the next request, whichever handler is free
            if control.stop.is_set():
                return
            await producer.run_in_transaction(transfer, [request], None)
            control.worst_moment()

    await asyncio.gather(*(handler() for _ in range(handlers)))


def credit(tx: streamq.BlockingSQL, batch: streamq.Batch) -> list[tuple[int, int, int, float]]:
    """Credit a batch of deposits, on the ledger database's own thread; returns them."""
    deposits = [DEPOSIT.unpack(record.value) for record in batch]
    tx.executemany(CREDIT, [(amount, to) for _, to, amount, _ in deposits])
    tx.executemany(RECORD_CREDIT, [(tid, amount) for tid, _, amount, _ in deposits])
    return deposits


# Credits a batch of deposits in the ledger's transaction; returns them (unpacked).
Credit = Callable[[Any, streamq.Batch], list[tuple[int, int, int, float]]]


async def consumer(address: str, db: str, target: int, apply_credits: Credit | None = None) -> None:
    """The ledger as a ``streamq.Consumer``; ``apply_credits``: the SQL of a ledger on
    another engine than SQLite (whose tables then exist already)."""
    control = Control()
    # A restarted producer makes the consumer log a reconnect warning: expected here.
    logging.getLogger("streamq").setLevel(logging.ERROR)
    if apply_credits is None:
        setup_consumer_db(db, CONSUMER_SCHEMA)
    # reconnect_timeout: start() waits for a producer that is being restarted, too.
    consumer = streamq.Consumer(
        address, STREAM, db=db, name=LEDGER, reconnect_timeout=CONNECT_TIMEOUT
    )
    await consumer.start()
    latencies = Latencies()
    credited, finished = 0, time.time()
    try:
        say("READY")
        async for batch in consumer:
            deposits = await consumer.apply(batch, apply_credits or credit)
            finished = time.time()
            latencies.record([due for *_, due in deposits], finished)
            credited += len(deposits)
            control.worst_moment()  # committed; the ack may not have reached the producer
            if (target and credited >= target) or control.stop.is_set():
                break
    finally:
        await consumer.close()
    say("DONE", finished, *latencies.figures())


def main(argv: list[str]) -> None:
    role, *args = argv
    if role == "producer":
        handlers, durability = (int(args[5]), args[6]) if len(args) > 5 else (1, "normal")
        _loop.run(
            producer(
                args[0],
                int(args[1]),
                int(args[2]),
                float(args[3]),
                int(args[4]),
                handlers,
                cast(Durability, durability),
            )
        )
    elif role == "consumer":
        _loop.run(consumer(args[0], args[1], int(args[2])))
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
