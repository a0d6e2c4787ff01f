"""The lock that keeps a SQLite store to one broker-main.

Two mains on one SQLite file would both dispatch, and each would give back the other's
handoffs as orphans. SQLite has no advisory locks that outlive a transaction, so the main
holds an OS file lock (``flock``) on ``<db>.main.lock`` for its whole life. The kernel
drops it when the process dies, however it dies, so a crashed main never leaves a stale
lock behind. Only the main takes it: the operator's command and applications' own
transactional enqueues open the database file itself, which the lock does not touch.
"""

from __future__ import annotations

import contextlib
import fcntl
import os

from broker.exceptions import ConfigurationError


def lock_path(database: str) -> str:
    """The lock file beside the database file."""
    return database + ".main.lock"


class MainLock:
    """Held from :meth:`acquire` to :meth:`release`; acquiring twice is a no-op."""

    def __init__(self, database: str) -> None:
        self.path = lock_path(database)
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise :class:`ConfigurationError` naming the main that holds it."""
        if self._fd is not None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise ConfigurationError(
                f"another broker-main{holder} is already running on this SQLite store (it "
                f"holds {self.path}): a SQLite store takes one main. Stop that main first, or "
                "use PostgreSQL to run several mains on one store"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        # The holder's pid, for the message a second main prints; informative only (the
        # lock itself is the kernel's).
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        # Closing the descriptor drops the lock; the file stays (removing it would race a
        # main that has just opened it).
        os.close(fd)


def _read_holder(fd: int) -> str:
    with contextlib.suppress(OSError, ValueError):
        pid = int(os.pread(fd, 32, 0).decode("ascii").strip())
        return f" (pid {pid})"
    return ""
