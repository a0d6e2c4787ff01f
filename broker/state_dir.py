"""A worker's state directory: the worker id it keeps across restarts, under a lock.

Affinity (:mod:`broker.affinity`) routes the recovery of a ``local_state`` job back to the
worker id that ran it, so a worker restarted on the same machine must come back under the
same id. The default id (host, pid, random) changes with every process; with a state
directory the first start writes its id there and every later start reads it back. The
directory is also where tasks keep their local state, so a new (or wiped) directory means
that state is gone, and the worker says so in its first hello.

One worker process at a time may use a directory: it holds an exclusive ``flock`` on
``lock`` inside it for as long as it runs, so two workers on one host never share an id
by accident (each needs its own directory). The lock goes with the process, even on
``kill -9``.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path

from broker.exceptions import ConfigurationError

ID_FILE = "worker-id"
LOCK_FILE = "lock"


@dataclass(frozen=True, slots=True)
class StateDir:
    """An opened state directory, locked while this object (its ``lock_fd``) lives."""

    path: Path
    worker_id: str
    fresh: bool
    """The directory had no id yet: whatever an earlier worker kept locally is not here."""
    lock_fd: int


def open_state_dir(path: Path, worker_id: str | None = None) -> StateDir:
    """Lock ``path`` (created if missing) and read its worker id, or write one: the given
    ``worker_id``, else ``<hostname>-<random>``.

    :raises ConfigurationError: another worker process holds the directory, or it keeps
        another id than the ``worker_id`` given.
    """
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigurationError(
            f"the state directory {path} is in use by another worker; give each worker its "
            "own --state-dir"
        ) from None
    id_file = path / ID_FILE
    if id_file.exists():
        kept = id_file.read_text().strip()
        if worker_id is not None and worker_id != kept:
            os.close(fd)
            raise ConfigurationError(
                f"the state directory {path} belongs to worker id {kept!r}, not {worker_id!r}"
            )
        return StateDir(path, kept, fresh=False, lock_fd=fd)
    chosen = worker_id or f"{socket.gethostname()}-{secrets.token_hex(4)}"
    temporary = path / f".{ID_FILE}.tmp"
    temporary.write_text(chosen + "\n")
    temporary.replace(id_file)
    return StateDir(path, chosen, fresh=True, lock_fd=fd)
