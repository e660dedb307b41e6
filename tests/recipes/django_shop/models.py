"""The shop's table (the log tables beside it are streamq's, made by ``streamq init``),
and the audit service's, in its own database."""

from __future__ import annotations

from django.db import models


class Order(models.Model):
    id = models.BigIntegerField(primary_key=True)  # chosen by the client: a retry is a 409
    item = models.TextField()

    class Meta:
        db_table = "orders"


class AuditEntry(models.Model):
    """An order as the audit consumer applied it; no unique index on purpose: an order
    applied twice would show as two rows."""

    seq = models.BigIntegerField()
    order_id = models.BigIntegerField()
    item = models.TextField()

    class Meta:
        db_table = "audit"
