"""A producer and a consumer in this process, publishing and applying with the oracle's effect.

Shared by the network-fault and the disk-full tests: the publisher runs transactions
(one in eight rolled back after publishing, so phantoms would show), the applier applies
every batch with the non-idempotent effect of tests/oracle.py, and the whole history is
recorded for ``check()``.
"""

from __future__ import annotations

import asyncio
import random
import sqlite3
from pathlib import Path

from streamq import Consumer, Producer, ServerSettings
from streamq.wire.transport import parse_address

from .oracle import (
    ADD_TO_SUM,
    APPLY_ROWS,
    EFFECT_SCHEMA,
    History,
    Report,
    amount,
    check,
    read_effects,
    read_log,
)

STREAM = "orders"
NAME = "billing"
# Small timeouts, so that faults are noticed quickly.
SETTINGS = ServerSettings(heartbeat_interval=0.1, handshake_timeout=1.0, idle_timeout=1.0)


class _RolledBack(Exception):
    pass


class Pipeline:
    """A producer's database and a consumer's, and the history of what went between them."""

    def __init__(self, tmp_path: Path, seed: int, producer_db: Path | None = None) -> None:
        self.producer_db = str(producer_db or tmp_path / "producer.db")
        self.consumer_db = str(tmp_path / "consumer.db")
        self.rng = random.Random(seed)
        self.history = History(complete=True)
        self.producer: Producer | None = None
        self.port = 0
        with sqlite3.connect(self.consumer_db) as db:
            for statement in EFFECT_SCHEMA:
                db.execute(statement)
        db.close()

    async def start_producer(self) -> Producer:
        """Start (or restart, on the same port) the producer."""
        self.producer = Producer(self.producer_db, port=self.port, settings=SETTINGS)
        await self.producer.start()
        self.port = parse_address(self.producer.address)[1]
        await self.producer.create_stream(STREAM)
        return self.producer

    async def publish(self, transactions: int, pause: float = 0.0, size: int = 8) -> None:
        """Transactions of 1 to 20 records, one in eight rolled back after publishing.

        A transaction that fails (e.g. the disk is full) raises; its records count as
        attempted, never as acknowledged.
        """
        assert self.producer is not None
        for _ in range(transactions):
            padding = b"%0*d" % (size, self.rng.randrange(10**size))
            values = [padding + b":%d" % self.rng.randint(1, 999)]
            values *= self.rng.randint(1, 20)
            roll_back = self.rng.random() < 0.125
            try:
                async with self.producer.transaction() as tx:
                    seqs = await tx.publish_many(STREAM, values)
                    for seq, value in zip(seqs, values, strict=True):
                        self.history.attempt(seq, value)
                    if roll_back:
                        raise _RolledBack
            except _RolledBack:
                continue
            self.history.acknowledged.update(zip(seqs, values, strict=True))
            await asyncio.sleep(pause)

    async def apply(self, consumer: Consumer) -> None:
        """Apply every batch, recording it as pushed first."""
        async for batch in consumer:
            rows = [(record.seq, record.value) for record in batch]
            self.history.pushed.extend(rows)
            async with consumer.transaction(batch) as tx:
                await tx.executemany(APPLY_ROWS, rows)
                await tx.execute(ADD_TO_SUM, (sum(amount(value) for _, value in rows),))

    def check(self) -> Report:
        """The oracle on the whole history; fails the test on any anomaly."""
        history = self.history
        history.committed = read_log(self.producer_db, STREAM)
        history.applied, history.position, history.stored_sum = read_effects(
            self.consumer_db, NAME, STREAM
        )
        report = check(history)
        assert report.ok and report.records == len(history.acknowledged) > 0, report
        return report
