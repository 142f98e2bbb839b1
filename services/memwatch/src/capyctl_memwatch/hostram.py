"""Host RAM: /proc/meminfo, bounded by the cgroup v2 memory limits the process runs under.

The file roots are injectable, so the parsing is tested on fixture trees.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from capycommon.domain.memory import HostRam

PROC = Path("/proc")
CGROUP = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class Meminfo:
    total_bytes: int
    available_bytes: int


@dataclass(frozen=True)
class CgroupLimit:
    """One cgroup's `memory.max` and `memory.current`, in bytes."""

    path: Path
    limit_bytes: int
    current_bytes: int

    @property
    def headroom_bytes(self) -> int:
        return max(0, self.limit_bytes - self.current_bytes)


def parse_meminfo(text: str) -> Meminfo:
    """MemTotal and MemAvailable (kB in the file) in bytes; MemFree when no MemAvailable."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[name.strip()] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    if "MemTotal" not in values:
        raise ValueError("no MemTotal line in meminfo")
    available = values.get("MemAvailable", values.get("MemFree", 0))
    return Meminfo(total_bytes=values["MemTotal"], available_bytes=available)


def unified_cgroup(text: str) -> PurePosixPath | None:
    """The cgroup v2 path from /proc/<pid>/cgroup (its `0::/path` line), if any."""
    for line in text.splitlines():
        if line.startswith("0::"):
            path = PurePosixPath(line[3:].strip() or "/")
            # Outside our cgroup namespace the path climbs (`/../..`): only the root is ours.
            return PurePosixPath("/") if ".." in path.parts else path
    return None


def _cgroup_dirs(root: Path, path: PurePosixPath) -> list[Path]:
    """The cgroup's folder under `root` and every ancestor up to `root`, leaf first."""
    relative = path.relative_to("/") if path.is_absolute() else path
    leaf = root.joinpath(*relative.parts)
    return [leaf, *list(leaf.parents)[: len(relative.parts)]]


def read_limit(folder: Path) -> CgroupLimit | None:
    """The folder's memory limit, or None when it has none (`max`, or no such files)."""
    try:
        limit = (folder / "memory.max").read_text().strip()
        if limit == "max":
            return None
        current = (folder / "memory.current").read_text().strip()
        return CgroupLimit(folder, int(limit), int(current))
    except (OSError, ValueError):
        return None


def cgroup_limits(cgroup_root: Path, path: PurePosixPath) -> list[CgroupLimit]:
    """The limits on the cgroup and its ancestors, leaf first (a parent's limit binds too)."""
    return [found for d in _cgroup_dirs(cgroup_root, path) if (found := read_limit(d))]


def combine(meminfo: Meminfo, limits: list[CgroupLimit]) -> HostRam:
    """available = min(MemAvailable, limit - current over every limited cgroup)."""
    if not limits:
        return HostRam(
            total_bytes=meminfo.total_bytes,
            available_bytes=meminfo.available_bytes,
            source="meminfo",
        )
    total = min([meminfo.total_bytes, *(c.limit_bytes for c in limits)])
    available = min([meminfo.available_bytes, *(c.headroom_bytes for c in limits)])
    return HostRam(total_bytes=total, available_bytes=min(available, total), source="cgroup")


@dataclass(frozen=True)
class HostRamReader:
    """Reads host RAM as this process sees it."""

    proc_root: Path = PROC
    cgroup_root: Path = CGROUP
    pid: str = "self"

    def read(self) -> HostRam:
        meminfo = parse_meminfo((self.proc_root / "meminfo").read_text())
        try:
            path = unified_cgroup((self.proc_root / self.pid / "cgroup").read_text())
        except OSError:
            path = None
        limits = [] if path is None else cgroup_limits(self.cgroup_root, path)
        return combine(meminfo, limits)
