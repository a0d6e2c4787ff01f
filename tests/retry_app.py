"""Tasks with retry policies, for the retry-policy tests; imported by real child
processes (pooled mode), so the worker must judge the failure from the child's report."""

from __future__ import annotations

from broker.tasks.registry import task


class PaymentDeclined(ValueError):
    """A failure no retry can fix: the card was declined."""


@task(mode="pooled", retries=5, dont_retry_on=(PaymentDeclined,))
def charge(amount: int) -> None:
    raise PaymentDeclined(f"card declined for {amount}")


@task(mode="pooled", retries=2, dont_retry_on=(PaymentDeclined,))
def flaky_charge(amount: int) -> None:
    raise ConnectionError(f"gateway unreachable while charging {amount}")


@task(mode="pooled", retries=5, retry_on=(ConnectionError,))
def only_network(amount: int) -> None:
    raise KeyError(amount)


@task(mode="pooled", retries=5)
def add(a: int, b: int) -> int:
    return a + b


def hour_per_failure(failures: int) -> float:
    """A task's own backoff: an hour per failure so far."""
    return 3600.0 * failures


@task(mode="pooled", retries=3, backoff=hour_per_failure)
def patient(amount: int) -> None:
    raise ConnectionError(f"gateway unreachable while charging {amount}")


@task(mode="pooled", retries=1, backoff=lambda failures: -5)
def badly_backed_off(amount: int) -> None:
    raise ConnectionError(f"gateway unreachable while charging {amount}")
