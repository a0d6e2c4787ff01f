"""The app's code as a user writes it: no ``adapters`` import, no store object."""

from __future__ import annotations

from django.db import transaction

from broker.contrib.django import enqueue
from broker.jobs import EnqueueResult
from tests.django_shop.models import Order


class PaymentDeclined(Exception):
    pass


def place_order(number: int, *, declined: bool = False) -> EnqueueResult | None:
    """Save the order and enqueue its shipping; a declined payment rolls both back."""
    with transaction.atomic():
        Order.objects.create(number=number)
        job = enqueue("shop.ship", [number], idempotency_key=f"ship-{number}")
        if declined:
            raise PaymentDeclined(number)
    return job
