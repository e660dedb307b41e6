"""Recipe: the audit service written with Django's ORM, each batch applied exactly once.

    ORDERS_DB=audit.db DJANGO_SETTINGS_MODULE=tests.recipes.django_shop.settings \
        python -m tests.recipes.django_shop.audit 127.0.0.1:7400 audit.db

The ORM's rows and the consumer's position (``streamq.save_position``) commit in one
``transaction.atomic()`` block, on a thread: Django's connections are per thread, and its
ORM refuses to run on an event loop.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import django

import streamq

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.recipes.django_shop.settings")
django.setup()

from django.db import connection, transaction  # noqa: E402 (after django.setup)

from .models import AuditEntry  # noqa: E402

NAME = "audit"


def apply(batch: streamq.Batch) -> None:
    entries = []
    for record in batch:
        order = json.loads(record.value)
        entries.append(AuditEntry(seq=record.seq, order_id=order["id"], item=order["item"]))
    with transaction.atomic():
        AuditEntry.objects.bulk_create(entries)
        streamq.save_position(connection, batch)


async def audit(address: str, db: str) -> None:
    async with streamq.Consumer(
        address, "orders", db=db, name=NAME, reconnect_timeout=30
    ) as consumer:
        print(f"auditing {address} from seq {consumer.applied + 1} (Django ORM)", flush=True)
        async for batch in consumer:
            await asyncio.to_thread(apply, batch)


if __name__ == "__main__":
    asyncio.run(audit(sys.argv[1], sys.argv[2]))
