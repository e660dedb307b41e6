"""Recipe: the audit service, applying each order record exactly once into its own database.

    python -m tests.recipes.audit 127.0.0.1:7400 audit.db

Its table has no unique index on purpose: an order applied twice would show as two rows.
The position is stored by ``consumer.transaction`` in the same commit as those rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import sys

import streamq

NAME = "audit"
SCHEMA = """CREATE TABLE IF NOT EXISTS audit (
    seq INTEGER NOT NULL, order_id INTEGER NOT NULL, item TEXT NOT NULL
)"""


async def audit(address: str, db: str) -> None:
    with contextlib.closing(sqlite3.connect(db)) as conn, conn:
        conn.execute(SCHEMA)
    async with streamq.Consumer(
        address, "orders", db=db, name=NAME, reconnect_timeout=30
    ) as consumer:
        print(f"auditing {address} from seq {consumer.applied + 1}", flush=True)
        async for batch in consumer:
            rows = []
            for record in batch:
                order = json.loads(record.value)
                rows.append((record.seq, order["id"], order["item"]))
            async with consumer.transaction(batch) as tx:
                await tx.executemany("INSERT INTO audit VALUES (?, ?, ?)", rows)


if __name__ == "__main__":
    asyncio.run(audit(sys.argv[1], sys.argv[2]))
