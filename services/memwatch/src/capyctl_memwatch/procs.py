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
    (or from the simulated claims when host RAM is simulated)."""

    observe: Callable[[], Observation]
    proc_root: Path = PROC

    def measure(self, pgids: Collection[int]) -> dict[int, GroupUse]:
        if not pgids:
            return {}
        try:
            observation = self.observe()
        except DeviceUnobserved:
            return {}  # no sample this step; the readings loop reports the failure
        device = observation.device_by_pid()
        members = group_members(pgids, self.proc_root)
        return {
            pgid: GroupUse(
                device_bytes=sum(device.get(pid, 0) for pid in pids),
                host_bytes=sum(self._host(pid, observation.host_by_pid) for pid in pids),
                pids=len(pids),
            )
            for pgid, pids in members.items()
        }

    def _host(self, pid: int, simulated: dict[int, int] | None) -> int:
        return rss_bytes(pid, self.proc_root) if simulated is None else simulated.get(pid, 0)


__all__ = ["GroupMeter", "StatFields", "group_members", "parse_stat", "parse_vmrss", "rss_bytes"]
