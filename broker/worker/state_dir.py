"""A worker's state directory: the worker id it keeps across restarts, under a lock.

Affinity (:mod:`broker.core.affinity`) routes the recovery of a ``local_state`` job back to the
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

import contextlib
import fcntl
import os
import secrets
import socket
import stat
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

    The directory is opened without following a symbolic link, and must belong to this
    process's user and be writable by no one else; its files are opened through it, again
    without following links. Otherwise whoever could plant a link there (a shared ``/tmp``)
    would have the worker write its id, and tasks their state, into a file of their choice.

    :raises ConfigurationError: the path is a link, or not the user's own private
        directory; another worker process holds it; or it keeps another id than the
        ``worker_id`` given.
    """
    with contextlib.suppress(FileExistsError):  # a link or a file: refused just below
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory = _open_directory(path)
    try:
        return _lock_and_read(path, directory, worker_id)
    except OSError as exc:  # ELOOP: a link planted for one of its files
        raise ConfigurationError(f"cannot use {path} as the state directory: {exc}") from None
    finally:
        os.close(directory)


def _open_directory(path: Path) -> int:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        # O_NOFOLLOW with O_DIRECTORY: ENOTDIR (or ELOOP) for a link; the message only
        # looks again.
        why = "it is a symbolic link" if path.is_symlink() else exc.strerror
        raise ConfigurationError(
            f"cannot use {path} as the state directory: {why}; give --state-dir a directory "
            "of this user's own, not a link"
        ) from None
    info = os.fstat(fd)
    problem = None
    if info.st_uid != os.geteuid():
        problem = f"it belongs to uid {info.st_uid}, not to this worker's user (uid {os.geteuid()})"
    elif info.st_mode & 0o022:
        problem = (
            f"others may write to it (mode {stat.S_IMODE(info.st_mode):04o}): chmod go-w it, "
            "or use a directory of its own"
        )
    if problem is not None:
        os.close(fd)
        raise ConfigurationError(f"cannot use {path} as the state directory: {problem}")
    return fd


def _lock_and_read(path: Path, directory: int, worker_id: str | None) -> StateDir:
    flags = os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT | flags, 0o600, dir_fd=directory)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigurationError(
            f"the state directory {path} is in use by another worker; give each worker its "
            "own --state-dir"
        ) from None
    try:
        kept = _read(directory, ID_FILE)
        if kept is not None:
            if worker_id is not None and worker_id != kept:
                raise ConfigurationError(
                    f"the state directory {path} belongs to worker id {kept!r}, not {worker_id!r}"
                )
            return StateDir(path, kept, fresh=False, lock_fd=fd)
        chosen = worker_id or f"{socket.gethostname()}-{secrets.token_hex(4)}"
        _write(directory, ID_FILE, chosen + "\n")
        return StateDir(path, chosen, fresh=True, lock_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def _read(directory: int, name: str) -> str | None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, encoding="utf-8") as file:
        return file.read().strip()


def _write(directory: int, name: str, text: str) -> None:
    """Replace ``name`` in ``directory`` at once: a new file (never an existing one, nor
    a link's target) written in full, then renamed over it."""
    temporary = f".{name}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temporary, dir_fd=directory)  # left by a crash, or planted
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    with os.fdopen(os.open(temporary, flags, 0o600, dir_fd=directory), "w") as file:
        file.write(text)
    os.replace(temporary, name, src_dir_fd=directory, dst_dir_fd=directory)
