"""Recipe: a consumer group's worker, run as many times as you like (docs/guides/groups.md,
"Deploying a group").

    python -m tests.recipes.billing 127.0.0.1:7400 billing.db --shares 8

A member of group ``billing`` on stream ``orders``: applies each batch as rows of
``credits`` in its own SQLite database, the position in the same commit. The table has
no unique index on purpose: a record applied twice would show as two rows, and the rows'
order (rowid) is the order they were applied in. SIGTERM (supervisorctl stop, a
restart) closes the member, which gives its shares back at once; a ``kill -9`` leaves
them to the others, who take them from the stored positions.

``member`` is the part gunicorn's workers run in a thread (tests/recipes/billing_app.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sqlite3
from collections.abc import Callable

import streamq
from streamq._loop import run

GROUP, STREAM = "billing", "orders"
SCHEMA = """CREATE TABLE IF NOT EXISTS credits (
    seq INTEGER NOT NULL, key TEXT NOT NULL, n INTEGER NOT NULL, pid INTEGER NOT NULL
)"""


def rows_of(batch: streamq.Batch) -> list[tuple[int, str, int, int]]:
    """One ``credits`` row per record: its seq, key and number, and who applied it."""
    pid = os.getpid()
    return [(r.seq, (r.key or b"").decode(), json.loads(r.value)["n"], pid) for r in batch]


async def member(
    address: str,
    db: str,
    shares: int,
    *,
    joined: Callable[[streamq.GroupConsumer], None] = lambda group: None,
) -> None:
    """Be a member until cancelled (then give the shares back); ``joined`` is told the
    group once this worker is a member."""
    with contextlib.closing(sqlite3.connect(db, timeout=20)) as conn, conn:
        conn.execute(SCHEMA)  # every worker at its start: the first one makes it
    async with streamq.GroupConsumer(
        address, STREAM, db=db, name=GROUP, shares=shares, reconnect_timeout=30
    ) as group:
        joined(group)
        reporter = asyncio.create_task(_report(group))
        try:
            async for batch in group:
                try:
                    async with group.transaction(batch) as tx:
                        await tx.executemany(
                            "INSERT INTO credits VALUES (?, ?, ?, ?)", rows_of(batch)
                        )
                except streamq.LeaseLostError:
                    continue  # the share moved on: its new holder applies this batch
        finally:
            reporter.cancel()


async def _report(group: streamq.GroupConsumer) -> None:
    """A line whenever the shares held change: which process holds what, in its log."""
    shown = None
    while True:
        if group.held != shown:
            shown = group.held
            print(f"pid {os.getpid()}: member {group.member} holds shares {shown}", flush=True)
        await asyncio.sleep(0.1)


async def _until_terminated(address: str, db: str, shares: int) -> None:
    """``member`` until SIGTERM or SIGINT, which close it (its shares given back)."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, task.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        await member(address, db, shares)
    print(f"pid {os.getpid()}: left the group", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("address", help="the producer serving the stream: HOST:PORT")
    parser.add_argument("db", help="the group's SQLite database (positions, leases, credits)")
    parser.add_argument("--shares", type=int, default=8, help="the group's split")
    args = parser.parse_args()
    run(_until_terminated(args.address, args.db, args.shares))


if __name__ == "__main__":
    main()
