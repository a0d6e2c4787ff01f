"""The one way a background loop survives its own failures: log, sleep, try again.

The main's long-lived tasks (the store listener, retention, lease recovery) must
outlive any error in one pass: a task that died of a lost database connection
would leave the broker running without it and nobody told. :func:`retrying` is the
single place that decides how such a failure is handled, so every loop logs it the
same way (``"<what> failed, retrying error=..."``) and none can swallow a
cancellation by mistake.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from broker.model.logs import log_event

T = TypeVar("T")


async def retrying(
    what: str,
    attempt: Callable[[], Awaitable[T]],
    *,
    interval: float,
    logger: logging.Logger,
    on_error: Callable[[], None] | None = None,
    wake: asyncio.Event | None = None,
) -> T:
    """Await ``attempt()`` until it returns, and return what it returned.

    Each failure is logged as a warning (``"<what> failed, retrying"``, with the error
    as a field), then ``on_error`` is called (say, to fall back to polling while a
    listener is down), and the next attempt comes ``interval`` seconds later, or as
    soon as ``wake`` is set (it is cleared then, so one wake-up shortens one wait).
    Cancellation is never caught: it ends the retries at once.
    """
    while True:
        try:
            return await attempt()
        except Exception as exc:  # not CancelledError, a BaseException: that ends the loop
            log_event(logger, logging.WARNING, f"{what} failed, retrying", error=repr(exc))
            if on_error is not None:
                on_error()
        if wake is None:
            await asyncio.sleep(interval)
        else:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancellation
            # that arrives as ``wake`` is set.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await wake.wait()
            wake.clear()


__all__ = ["retrying"]
