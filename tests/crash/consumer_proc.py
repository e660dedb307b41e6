"""A consumer process for the crash tests (tests/crashrun.py).

    consumer_proc.py ADDRESS DB TARGET [--journal FILE] [--heartbeat-timeout S]
                     [--survive-db-outages S]

Consumer "billing" of stream ``orders``: applies every batch with the oracle's
deliberately non-idempotent effect (a row per record in ``applied``, which has no
unique index, and the record's amount added to ``applied_sum``) in the transaction
that stores its position, in DB (a SQLite file or a ``postgresql://`` URL). Exits 0
once its position reaches TARGET. Every batch received is journalled as a push before
it is applied.

Fault points (``STREAMQ_FAULT=POINT:N``, see faults.py): ``before-tx`` (the N-th
batch received, before its transaction), ``after-apply`` (inside the N-th
transaction, effects written, before COMMIT), ``after-commit`` (right after the
N-th COMMIT, before reading the next batch). ``STREAMQ_HOLD=after-apply:N`` stops the
process at that point of the N-th transaction (see faults.py) until the test continues it.

``--survive-db-outages S`` (PostgreSQL, whose server the harness kills): a batch whose
transaction fails because the server went away is applied again on the same consumer
(its store connects again), until it commits, for up to S seconds of consecutive
failures; each failure prints ``DBERROR <error>``. If the retry finds the batch already
applied (the COMMIT had gone through, its reply was lost: ``OutOfOrderBatchError``), or
the producer answers with an internal error (its own database away), the process
carries on with a new consumer, which starts from the stored position, and prints
``RESUME <why>``. Without the option, any such error ends the process; any other error
always does.

Prints ``SUBSCRIBED applied=<seq>`` once connected, ``COMMIT <n> last=<seq>``
after each transaction and ``DONE applied=<seq>`` at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import streamq
from streamq._loop import run
from streamq.errors import InternalServerError, OutOfOrderBatchError
from tests.crash.faults import FAULTS, HOLDS
from tests.crash.producer_proc import outage_errors
from tests.oracle import ADD_TO_SUM, APPLY_ROWS, Dialect, Journal, amount, dialect, effect_schema

STREAM = "orders"
NAME = "billing"


class Resume(Exception):
    """This consumer cannot go on; a new one starts from the stored position."""


def create_tables(db: str) -> None:
    d = dialect(db)
    with d.connect(db) as conn:
        for statement in effect_schema(d):
            conn.execute(statement)


class Applier:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.d: Dialect = dialect(args.db)
        self.journal = Journal(args.journal)
        self.outages = outage_errors(args.db) if args.survive_db_outages else ()
        self.failing_since: float | None = None  # the first of consecutive failures
        self.commits = 0
        self.applied = 0

    def failed(self, exc: BaseException) -> None:
        """Note a failure the process survives; re-raise it if they have lasted too long."""
        self.failing_since = self.failing_since or time.monotonic()
        if time.monotonic() - self.failing_since > self.args.survive_db_outages:
            raise exc

    async def run(self) -> int:
        """New consumers, each from the stored position, until one reaches the target."""
        while True:
            try:
                create_tables(self.args.db)
                await self.consume()
                break
            except Resume as exc:
                print(f"RESUME {exc}", flush=True)
            except self.outages as exc:  # the database away while starting up
                self.failed(exc)
                print(f"DBERROR {type(exc).__name__}: {str(exc).strip()[:200]}", flush=True)
                await asyncio.sleep(0.05)  # the server is being restarted: bounded above
        print(f"DONE applied={self.applied}", flush=True)
        self.journal.close()
        return 0

    async def consume(self) -> None:
        args = self.args
        # reconnect_timeout: start() also waits for a producer that is down (being restarted).
        consumer = streamq.Consumer(
            args.address,
            STREAM,
            db=args.db,
            name=NAME,
            reconnect_timeout=args.reconnect_timeout,
            connect_timeout=args.connect_timeout,
            heartbeat_timeout=args.heartbeat_timeout,
        )
        await consumer.start()
        try:
            self.applied = consumer.applied
            print(f"SUBSCRIBED applied={consumer.applied}", flush=True)
            if consumer.applied >= args.target:
                return
            try:
                async for batch in consumer:
                    await self.apply(consumer, batch)
                    self.applied = batch.last_seq
                    if batch.last_seq >= args.target:
                        return
            except InternalServerError as exc:
                # The producer could not read its database (being restarted) for this
                # subscription: not retried by streamq; this process starts a new consumer.
                if not self.outages:
                    raise
                self.failed(exc)
                raise Resume(f"{type(exc).__name__}: {exc}") from exc
        finally:
            await consumer.close()

    async def apply(self, consumer: streamq.Consumer, batch: streamq.Batch) -> None:
        rows = [(record.seq, record.value) for record in batch]
        self.journal.write("push", rows)
        if FAULTS.due("before-tx"):
            FAULTS.fire("before-tx", f"last={batch.last_seq}")
        retried = False
        while True:
            try:
                async with consumer.transaction(batch) as tx:
                    await tx.executemany(self.d.sql(APPLY_ROWS), rows)
                    await tx.execute(
                        self.d.sql(ADD_TO_SUM), (sum(amount(value) for _, value in rows),)
                    )
                    if HOLDS.due("after-apply"):
                        HOLDS.hold("after-apply", f"last={batch.last_seq}")
                    if FAULTS.due("after-apply"):
                        FAULTS.fire("after-apply", f"last={batch.last_seq}")
                break
            except OutOfOrderBatchError as exc:
                if not retried:
                    raise
                raise Resume(f"batch after {batch.after} already applied: {exc}") from exc
            except self.outages as exc:
                self.failed(exc)
                print(f"DBERROR {type(exc).__name__}: {str(exc).strip()[:200]}", flush=True)
                retried = True
                await asyncio.sleep(0.05)  # the server is being restarted: bounded above
        self.failing_since = None
        self.commits += 1
        print(f"COMMIT {self.commits} last={batch.last_seq}", flush=True)
        if FAULTS.due("after-commit"):
            FAULTS.fire("after-commit", f"last={batch.last_seq}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("address")
    parser.add_argument("db")
    parser.add_argument("target", type=int)
    parser.add_argument("--journal", default=None)
    parser.add_argument("--reconnect-timeout", type=float, default=30.0)
    parser.add_argument("--connect-timeout", type=float, default=5.0)
    parser.add_argument("--heartbeat-timeout", type=float, default=30.0)
    parser.add_argument("--survive-db-outages", type=float, default=0.0, metavar="SECONDS")
    sys.exit(run(Applier(parser.parse_args()).run()))
