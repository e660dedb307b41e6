"""``POST /orders``: the ORM's INSERT and the stream record commit in one transaction."""

from __future__ import annotations

import json

from django.db import IntegrityError, connection, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_GET, require_POST

import streamq

from .models import Order


@require_POST
def create_order(request: HttpRequest) -> JsonResponse:
    order = json.loads(request.body)
    order_id, item = int(order["id"]), str(order["item"])
    try:
        with transaction.atomic():  # BEGIN IMMEDIATE (settings: transaction_mode)
            Order.objects.create(id=order_id, item=item)
            value = json.dumps({"id": order_id, "item": item}).encode()
            seq = streamq.publish(connection, "orders", value, key=str(order_id).encode())
    except IntegrityError:
        return JsonResponse({"id": order_id, "error": "exists"}, status=409)
    return JsonResponse({"id": order_id, "seq": seq}, status=201)


@require_GET
def health(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok")
