"""Recipe: FastAPI on PostgreSQL through asyncpg (docs/guides/services.md, "FastAPI").

    DATABASE_URL=postgresql://... python -m tests.recipes.fastapi_app init-db
    DATABASE_URL=postgresql://... uvicorn tests.recipes.fastapi_app:app --workers 2

``POST /orders`` inserts the order and publishes its event in the request's one
transaction, on the pool's connection: both commit, or neither. A retry of an order that
committed gets 409 and publishes nothing. The answer carries the record's ``Receipt``:
on PostgreSQL a record's seq is given after its transaction commits, by the process that
serves the log (``streamq serve``), so a web worker does not know it; the consumer
applies the record by its key, the order id, and never needs it.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel

import streamq

SCHEMA = "CREATE TABLE IF NOT EXISTS orders (id bigint PRIMARY KEY, cents bigint NOT NULL)"


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Each worker process its own pool."""
    app.state.pool = await asyncpg.create_pool(os.environ["DATABASE_URL"], min_size=1, max_size=4)
    yield
    await app.state.pool.close()


app = FastAPI(lifespan=lifespan)


class Order(BaseModel):
    id: int
    cents: int


@app.post("/orders", status_code=201)
async def create_order(order: Order) -> dict[str, Any]:
    async with app.state.pool.acquire() as conn, conn.transaction():
        added = await conn.execute(
            "INSERT INTO orders (id, cents) VALUES ($1, $2) ON CONFLICT (id) DO NOTHING",
            order.id,
            order.cents,
        )
        if added == "INSERT 0 0":
            raise HTTPException(409, f"order {order.id} exists")
        receipt = await streamq.publish_async(
            conn, "orders", json.dumps(order.model_dump()).encode(), key=b"%d" % order.id
        )
    assert isinstance(receipt, streamq.Receipt)  # PostgreSQL: numbered after the commit
    return {"id": order.id, "receipt": {"xid": receipt.xid, "id": receipt.id}}


async def init_db() -> None:
    """The orders table (the log tables: ``streamq init``)."""
    conn = await asyncpg.connect(os.environ["DATABASE_URL"])
    try:
        await conn.execute(SCHEMA)
    finally:
        await conn.close()


if __name__ == "__main__":
    if sys.argv[1:] != ["init-db"]:
        raise SystemExit("usage: python -m tests.recipes.fastapi_app init-db")
    asyncio.run(init_db())
