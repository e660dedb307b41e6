"""A consumer group member process for tests/groups/test_groups.py.

    python -m tests.group_worker ADDRESS DB [--shares N] [--die-in-apply K] [--name NAME]

Member of group ``billing`` (or NAME) on stream ``orders``: applies each batch as rows of
``credits`` (seq unique, key, pid), under its lease. Prints ``JOINED <member>`` once
it is a member and ``HELD <shares>`` whenever the shares it holds change.
``--die-in-apply K``: SIGKILL itself inside the K-th transaction, the batch's rows
written and not committed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal

import streamq
from streamq._loop import run
from streamq.groups.group_consumer import GroupConsumer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("address")
    parser.add_argument("db")
    parser.add_argument("--shares", type=int, default=None)
    parser.add_argument("--die-in-apply", type=int, default=0)
    parser.add_argument("--lease-timeout", type=float, default=10.0)
    parser.add_argument("--name", default="billing")
    args = parser.parse_args()
    run(work(args))


async def work(args: argparse.Namespace) -> None:
    applies = 0
    placeholder = "%s" if args.db.startswith("postgres") else "?"
    insert = f"INSERT INTO credits (seq, key, pid) VALUES ({', '.join([placeholder] * 3)})"

    def credit(tx: streamq.BlockingSQL, batch: streamq.Batch) -> None:
        nonlocal applies
        applies += 1
        tx.executemany(insert, [(r.seq, r.key, os.getpid()) for r in batch])
        if applies == args.die_in_apply:
            os.kill(os.getpid(), signal.SIGKILL)

    async with GroupConsumer(
        args.address,
        "orders",
        db=args.db,
        name=args.name,
        shares=args.shares,
        lease_timeout=args.lease_timeout,
        reconnect_timeout=30,
    ) as group:
        print(f"JOINED {group.member}", flush=True)
        watcher = asyncio.create_task(report(group))
        try:
            async for batch in group:
                with contextlib.suppress(streamq.LeaseLostError):
                    await group.apply(batch, credit)
        finally:
            watcher.cancel()


async def report(group: GroupConsumer) -> None:
    shown = None
    while True:
        if group.held != shown:
            shown = group.held
            print(f"HELD {','.join(map(str, shown))}", flush=True)
        await asyncio.sleep(0.01)


if __name__ == "__main__":
    main()
