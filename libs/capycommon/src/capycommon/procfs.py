"""Processes from /proc: state, parent, process group and start time; never names.

The root is injectable so the parsing is tested on fixture trees.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
# More than a stat line holds: 52 numbers and a command name of at most 64 bytes.
STAT_MAX = 4096


@dataclass(frozen=True)
class StatFields:
    state: str
    ppid: int
    pgid: int
    # Start time in clock ticks after boot (field 22); None in a shortened line.
    start_ticks: int | None = None


def parse_stat(text: str) -> StatFields:
    """The fields after `pid (comm)`; comm may hold spaces and parentheses."""
    fields = text.rsplit(") ", 1)[1].split()
    start = int(fields[19]) if len(fields) > 19 else None
    return StatFields(state=fields[0], ppid=int(fields[1]), pgid=int(fields[2]), start_ticks=start)


def _read_stat(path: str) -> bytes | None:
    """A stat file's bytes, or None when the process is gone. Read with one open and one
    read: a walk of /proc reads hundreds of these, hostd and memwatch several a second."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(descriptor, STAT_MAX)
    except OSError:
        return None
    finally:
        os.close(descriptor)


def stat(pid: int, proc_root: Path = PROC) -> StatFields | None:
    """The process's fields now, or None when it is gone."""
    raw = _read_stat(f"{proc_root}/{pid}/stat")
    try:
        return None if raw is None else parse_stat(raw.decode(errors="replace"))
    except (IndexError, ValueError):
        return None


def group_members(pgids: Collection[int], proc_root: Path = PROC) -> dict[int, list[int]]:
    """For each wanted process group, its live (non-zombie) members."""
    found: dict[int, list[int]] = {pgid: [] for pgid in pgids}
    if not found:
        return found
    for name in os.listdir(proc_root):
        fields = stat(int(name), proc_root) if name.isdigit() else None
        if fields is not None and fields.pgid in found and fields.state != "Z":
            found[fields.pgid].append(int(name))
    return {pgid: sorted(pids) for pgid, pids in found.items()}


LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's `st` column


def listening_inodes(port: int, proc_root: Path = PROC) -> set[int]:
    """The socket inodes listening on TCP `port` (any address, IPv4 or IPv6)."""
    found: set[int] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc_root / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != LISTEN:
                continue
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if local_port == port:
                found.add(int(fields[9]))
    return found


def socket_inodes(pids: Collection[int], proc_root: Path = PROC) -> set[int]:
    """The socket inodes the processes hold open (`socket:[<inode>]` descriptors)."""
    found: set[int] = set()
    for pid in pids:
        try:
            descriptors = list((proc_root / str(pid) / "fd").iterdir())
        except OSError:
            continue
        for descriptor in descriptors:
            try:
                target = descriptor.readlink().name
            except OSError:
                continue
            if target.startswith("socket:["):
                found.add(int(target[8:-1]))
    return found


def parse_vmrss(text: str) -> int:
    """VmRSS of /proc/<pid>/status in bytes; 0 when absent (a zombie, a kernel thread)."""
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def rss_bytes(pid: int, proc_root: Path = PROC) -> int:
    """A process's resident memory in bytes; 0 when it cannot be read."""
    try:
        return parse_vmrss((proc_root / str(pid) / "status").read_text())
    except (OSError, IndexError, ValueError):
        return 0
