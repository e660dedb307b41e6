"""Recipe: the consumer of the FastAPI recipe, billing each order in its own PostgreSQL
database (docs/guides/services.md, "FastAPI").

    python -m tests.recipes.billing_pg 127.0.0.1:7400 postgresql://.../billing

Each batch's orders become rows of ``billed``, the position in the same commit. The table
has no unique index on purpose: an order billed twice would show as two rows. A ``kill
-9`` anywhere loses nothing and doubles nothing: started again, it resumes after the last
committed batch.
"""

from __future__ import annotations

import asyncio
import json
import sys

import psycopg

import streamq

SCHEMA = "CREATE TABLE IF NOT EXISTS billed (order_id bigint NOT NULL, cents bigint NOT NULL)"


async def bill(address: str, url: str) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute(SCHEMA)
    consumer = streamq.Consumer(address, "orders", db=url, name="billing", reconnect_timeout=60)
    async with consumer:
        async for batch in consumer:
            orders = [json.loads(record.value) for record in batch]
            async with consumer.transaction(batch) as tx:
                await tx.executemany(
                    "INSERT INTO billed (order_id, cents) VALUES (%s, %s)",
                    [(order["id"], order["cents"]) for order in orders],
                )


if __name__ == "__main__":
    asyncio.run(bill(sys.argv[1], sys.argv[2]))
