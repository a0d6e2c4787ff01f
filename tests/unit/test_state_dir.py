"""The worker's state directory: a kept id, a fresh-state flag, one worker at a time."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from broker.exceptions import ConfigurationError
from broker.worker.state_dir import open_state_dir


def test_a_restarted_worker_reads_back_the_id_its_first_start_wrote(tmp_path: Path) -> None:
    first = open_state_dir(tmp_path / "state")
    assert first.fresh and first.worker_id
    os.close(first.lock_fd)  # the process ends
    again = open_state_dir(tmp_path / "state")
    assert not again.fresh and again.worker_id == first.worker_id
    os.close(again.lock_fd)


def test_an_explicit_id_is_kept_and_must_match_afterwards(tmp_path: Path) -> None:
    os.close(open_state_dir(tmp_path, "w-1").lock_fd)
    os.close(open_state_dir(tmp_path, "w-1").lock_fd)
    with pytest.raises(ConfigurationError, match="belongs to worker id 'w-1', not 'w-2'"):
        open_state_dir(tmp_path, "w-2")


def test_two_workers_never_share_a_directory(tmp_path: Path) -> None:
    held = open_state_dir(tmp_path)
    with pytest.raises(ConfigurationError, match="in use by another worker"):
        open_state_dir(tmp_path)
    os.close(held.lock_fd)
    os.close(open_state_dir(tmp_path).lock_fd)


def test_a_planted_link_in_the_directory_is_never_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    state = tmp_path / "state"
    state.mkdir()
    (state / ".worker-id.tmp").symlink_to(victim)
    opened = open_state_dir(state, "w-1")
    os.close(opened.lock_fd)
    assert victim.read_text() == "precious\n", "the link was replaced, not written through"
    assert (state / "worker-id").read_text() == "w-1\n"
    (state / "worker-id").unlink()
    (state / "worker-id").symlink_to(victim)
    with pytest.raises(ConfigurationError, match=r"cannot use .* as the state directory"):
        open_state_dir(state)


def test_a_directory_others_may_write_or_another_user_owns_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ConfigurationError, match=r"others may write to it \(mode 0777\)"):
        open_state_dir(shared)
    if os.geteuid() == 0:  # only root can give a directory away
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 4321, 4321)
        with pytest.raises(ConfigurationError, match="belongs to uid 4321"):
            open_state_dir(theirs)
    assert not (shared / "worker-id").exists()
