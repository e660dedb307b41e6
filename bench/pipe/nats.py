"""NATS JetStream's side of the pipe workload: ``producer URL STREAM N SIZE`` and
``consumer URL STREAM DB N SIZE DURABILITY``.

The consumer does for exactly-once what the Kafka one does: it stores the stream
sequence it has applied up to in the same SQLite transaction as the records, starts its
(pull) consumer from that sequence, skips anything at or below it, and acks only after
the commit, so an ack never runs ahead of what the database holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import sys
import time

import nats.errors
import nats.js.errors
from nats.js import api

from streamq import _loop

from ..common import say, wait_line
from ..nats.clients import FETCH_THROUGHPUT, PUBLISH_THROUGHPUT, ack_checker, connected, fetch_size

CONSUMER = "pipe"  # the durable's name, one per stream


async def producer(url: str, stream: str, count: int, size: int) -> None:
    value = os.urandom(size)
    failed: list[BaseException] = []
    check = ack_checker(failed)

    async with connected(url) as client:
        js = client.jetstream(
            publish_async_max_pending=PUBLISH_THROUGHPUT["publish_async_max_pending"]
        )
        await js.stream_info(stream)
        say("READY")
        await asyncio.to_thread(wait_line, "GO")
        say("START", time.time())

        async def publish_all() -> None:
            for _ in range(count):
                ack = await js.publish_async(stream, value)  # waits while 4000 are unacked
                ack.add_done_callback(check)
            await js.publish_async_completed()

        await asyncio.wait_for(publish_all(), PUBLISH_THROUGHPUT["publish_deadline_s"])
        if failed:
            raise RuntimeError(f"{len(failed)} publishes failed, the first: {failed[0]!r}")
        say("PRODUCED", time.time())
        await asyncio.to_thread(wait_line, "STOP")


def open_db(db: str, durability: str) -> sqlite3.Connection:
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={durability.upper()}")
    conn.execute("CREATE TABLE IF NOT EXISTS applied (seq INTEGER, value BLOB)")
    conn.execute("CREATE TABLE IF NOT EXISTS positions (stream TEXT PRIMARY KEY, next INTEGER)")
    return conn


async def consumer(url: str, stream: str, db: str, count: int, size: int, durability: str) -> None:
    """Apply stream sequences up to ``count`` (resuming after a restart), then DONE."""
    conn = open_db(db, durability)
    row = conn.execute("SELECT next FROM positions WHERE stream = ?", (stream,)).fetchone()
    next_seq = int(row[0]) if row else 1
    async with connected(url) as client:
        js = client.jetstream()
        # The database, not the server, says where to start: a durable left by an earlier
        # run may be behind it (acks not sent) or, with a restored database, ahead of it.
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await js.delete_consumer(stream, CONSUMER)
        config = api.ConsumerConfig(
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=next_seq,
            ack_policy=api.AckPolicy.ALL,
            max_ack_pending=FETCH_THROUGHPUT["max_ack_pending"],
        )
        sub = await js.pull_subscribe(stream, durable=CONSUMER, stream=stream, config=config)
        say("READY")
        batch, timeout = fetch_size(size), FETCH_THROUGHPUT["fetch_timeout_s"]
        while next_seq <= count:
            try:
                messages = await sub.fetch(batch, timeout=timeout)
            except nats.errors.TimeoutError:
                continue
            rows = []
            for message in messages:
                seq = message.metadata.sequence.stream
                if seq < next_seq:
                    continue  # a redelivery of what is already applied
                if seq != next_seq:
                    raise RuntimeError(f"stream sequence {seq} after {next_seq - 1}: a gap")
                rows.append((seq, message.data))
                next_seq += 1
            if rows:
                conn.execute("BEGIN")
                conn.executemany("INSERT INTO applied VALUES (?, ?)", rows)
                conn.execute("INSERT OR REPLACE INTO positions VALUES (?, ?)", (stream, next_seq))
                conn.execute("COMMIT")
            if messages:
                await messages[-1].ack()  # ack_policy=all: everything up to it, once committed
        say("DONE", time.time())
    conn.close()


if __name__ == "__main__":
    role, *args = sys.argv[1:]
    if role == "producer":
        _loop.run(producer(args[0], args[1], int(args[2]), int(args[3])))
    else:
        _loop.run(consumer(args[0], args[1], args[2], int(args[3]), int(args[4]), args[5]))
