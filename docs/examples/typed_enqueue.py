"""Typed enqueue, as the docs show it: mypy checks every call below against the task's
signature (``tests/unit/test_typed_enqueue_mypy.py`` runs mypy on this file)."""

from __future__ import annotations

import broker
from broker import task


@task(retries=3)
async def send_email(to: str, subject: str = "", *, urgent: bool = False) -> None:
    """Send one email (the body is left out of the example)."""


async def signup(address: str) -> None:
    await send_email.enqueue(address, subject="Welcome")
    await send_email.options(queue="mail", priority=5, delay=10).enqueue(address, urgent=True)
    await send_email.options(idempotency_key=f"welcome:{address}").enqueue(address)


def signup_from_a_wsgi_view(address: str) -> None:
    send_email.enqueue_sync(address, subject="Welcome")


if __name__ == "__main__":
    broker.configure("127.0.0.1", 7390)
    signup_from_a_wsgi_view("a@example.com")
