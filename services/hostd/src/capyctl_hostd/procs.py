"""Engine processes: identity by PID and start time, process groups, stopping, cleanup.

Processes are never found or killed by name: only by the PID, start time and process group
recorded at launch.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Collection
from pathlib import Path

from capycommon import procfs
from capycommon.domain.instances import ProcessIdentity

PROC = procfs.PROC
SHM = Path("/dev/shm")  # noqa: S108 - the POSIX shared-memory folder, not a temp file


def identity(pid: int) -> ProcessIdentity | None:
    """The process as it is now: PID, process group, start time."""
    fields = procfs.stat(pid)
    if fields is None or fields.start_ticks is None:
        return None
    return ProcessIdentity(pid=pid, pgid=fields.pgid, start_ticks=fields.start_ticks)


def is_alive(recorded: ProcessIdentity) -> bool:
    """The recorded process still runs (same PID *and* start time; a zombie has ended)."""
    fields = procfs.stat(recorded.pid)
    return fields is not None and fields.state != "Z" and fields.start_ticks == recorded.start_ticks


def group_members(pgid: int) -> list[int]:
    """Live processes of a process group (the group outlives its leader)."""
    return procfs.group_members([pgid])[pgid]


def in_group(pids: Collection[int], pgid: int) -> list[int]:
    """Those of `pids` that are live processes of the group: the same as the group's members
    among them, from their own /proc entries rather than a walk of all of /proc."""
    found = []
    for pid in pids:
        fields = procfs.stat(pid)
        if fields is not None and fields.pgid == pgid and fields.state != "Z":
            found.append(pid)
    return sorted(found)


def foreign_listeners(port: int, pgid: int) -> set[int]:
    """Sockets listening on `port` that the process group does not hold: another process
    shares the port (engines bind with SO_REUSEPORT, so the kernel lets both listen and
    splits the connections between them).

    The group's leader (the engine's server, which listens) is asked first; the whole group
    is looked for, a walk of /proc, only when the leader does not hold every listener."""
    listening = procfs.listening_inodes(port)
    if not listening - procfs.socket_inodes([pgid]):
        return set()
    return listening - procfs.socket_inodes(group_members(pgid))


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signum)


async def stop_group(pgid: int, grace_s: float = 20.0) -> None:
    """SIGTERM to the whole group, wait, then SIGKILL the group; returns once it is gone."""
    _signal_group(pgid, signal.SIGTERM)
    if await wait_gone(pgid, grace_s):
        return
    _signal_group(pgid, signal.SIGKILL)
    if not await wait_gone(pgid, 10.0):
        raise RuntimeError(f"process group {pgid} survived SIGKILL")


async def wait_gone(pgid: int, timeout_s: float) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while group_members(pgid):
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(0.1)
    return True


def shm_names() -> frozenset[str]:
    """The /dev/shm entries there are now."""
    if not SHM.is_dir():
        return frozenset()
    return frozenset(entry.name for entry in SHM.iterdir())


def shm_held_by(pids: list[int]) -> set[str]:
    """The /dev/shm entries these processes map or hold open, whatever their names."""
    found: set[str] = set()
    prefix = f"{SHM}/"
    for pid in pids:
        try:
            maps = (PROC / str(pid) / "maps").read_text()
            descriptors = list((PROC / str(pid) / "fd").iterdir())
        except OSError:
            continue
        paths = [line.split(maxsplit=5)[-1] for line in maps.splitlines() if prefix in line]
        for descriptor in descriptors:
            with contextlib.suppress(OSError):
                paths.append(str(descriptor.readlink()))
        for path in paths:
            if path.startswith(prefix):
                found.add(path[len(prefix) :].removesuffix(" (deleted)").split("/")[0])
    return found


def settled_children(pgid: int, members: list[int], settled_s: float) -> dict[int, int]:
    """The members whose parent is the group's leader and that have run `settled_s` or
    longer, by PID, with their start ticks (a helper the leader runs for a moment is not
    counted)."""
    now_ticks = _uptime_s() * _TICKS
    found: dict[int, int] = {}
    for pid in members:
        fields = procfs.stat(pid)
        if fields is None or fields.ppid != pgid or fields.start_ticks is None:
            continue
        if now_ticks - fields.start_ticks >= settled_s * _TICKS:
            found[pid] = fields.start_ticks
    return found


_TICKS = os.sysconf("SC_CLK_TCK")


def _uptime_s() -> float:
    return float((PROC / "uptime").read_text().split()[0])


def shm_segments_of(pids: set[int]) -> list[str]:
    """The /dev/shm entries named after these processes (e.g. multi_tokenizer_args_<pid>)."""
    found: list[str] = []
    if not SHM.is_dir():
        return found
    for entry in SHM.iterdir():
        parts = set(entry.name.replace("-", "_").split("_"))
        if any(str(pid) in parts for pid in pids):
            found.append(entry.name)
    return sorted(found)


def _held(name: str) -> bool:
    target = str(SHM / name)
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if target in (entry / "maps").read_text():
                return True
        except OSError:
            continue
    return False


def remove_segments(names: list[str]) -> list[str]:
    """Unlink the segments no process holds; returns those removed."""
    removed = []
    for name in names:
        if (SHM / name).exists() and not _held(name):
            (SHM / name).unlink(missing_ok=True)
            removed.append(name)
    return removed
