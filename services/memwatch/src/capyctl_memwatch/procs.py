"""Process groups from /proc: what a group holds (its members come from capycommon.procfs).

Members are found by scanning `/proc/<pid>/stat` for the process group id (field 5), never
by name. The root is injectable, so the parsing is tested on fixture trees.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from capycommon.errors import DeviceUnobserved
from capycommon.procfs import StatFields, group_members, parse_stat, parse_vmrss, rss_bytes
from capyctl_memwatch.backends import Observation
from capyctl_memwatch.hostram import PROC
from capyctl_memwatch.peaks import GroupUse


@dataclass(frozen=True)
class GroupMeter:
    """What each process group holds: device bytes from the backend, host bytes from RSS
    (or from the simulated claims when host RAM is simulated).

    A group's device bytes are the most it holds on any one GPU, not the sum over its GPUs:
    an engine split over several GPUs (a worker process on each, or one process holding
    memory on all) needs that much on each GPU of its set."""

    observe: Callable[[], Observation]
    proc_root: Path = PROC

    def measure(self, pgids: Collection[int]) -> dict[int, GroupUse]:
        if not pgids:
            return {}
        try:
            observation = self.observe()
        except DeviceUnobserved:
            return {}  # no sample this step; the readings loop reports the failure
        members = group_members(pgids, self.proc_root)
        return {pgid: self._use(observation, pids) for pgid, pids in members.items()}

    def _use(self, observation: Observation, pids: list[int]) -> GroupUse:
        held = observation.held_by(pids)
        return GroupUse(
            device_bytes=max(held.values(), default=0),
            host_bytes=sum(self._host(pid, observation.host_by_pid) for pid in pids),
            pids=len(pids),
            devices=len(held),
        )

    def _host(self, pid: int, simulated: dict[int, int] | None) -> int:
        return rss_bytes(pid, self.proc_root) if simulated is None else simulated.get(pid, 0)


__all__ = ["GroupMeter", "StatFields", "group_members", "parse_stat", "parse_vmrss", "rss_bytes"]
