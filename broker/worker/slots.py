"""Each runner's free slots, counted once per look and only for the modes looked at."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from broker.jobs import ExecutionMode
from broker.tasks.runner import Runner


class FreeSlots(Mapping[ExecutionMode, int]):
    """Each runner's free slots now, asked of a runner only once the state looks at its
    mode, and once: the state looks only at the modes it holds jobs of, and the pooled
    runner walks its children to count (a worker counts for every job it receives and
    every job that ends)."""

    __slots__ = ("_counted", "_runners")

    def __init__(self, runners: Mapping[ExecutionMode, Runner]) -> None:
        self._runners = runners
        self._counted: dict[ExecutionMode, int] = {}

    def __getitem__(self, mode: ExecutionMode) -> int:
        try:
            return self._counted[mode]
        except KeyError:
            free = self._counted[mode] = self._runners[mode].free_slots()
            return free

    def get(self, mode: ExecutionMode, default: int | None = None) -> int | None:  # type: ignore[override]
        return self[mode] if mode in self._runners else default

    def __iter__(self) -> Iterator[ExecutionMode]:
        return iter(self._runners)

    def __len__(self) -> int:
        return len(self._runners)
