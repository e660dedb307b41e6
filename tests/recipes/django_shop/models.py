"""The business table; the log tables beside it are streamq's (made by ``Producer`` once)."""

from __future__ import annotations

from django.db import models


class Order(models.Model):
    id = models.BigIntegerField(primary_key=True)  # chosen by the client: a retry is a 409
    item = models.TextField()

    class Meta:
        db_table = "orders"
