"""Engine processes: identity by PID and start time, process groups, stopping, cleanup.

Processes are never found or killed by name: only by the PID, start time and process group
recorded at launch.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

from capycommon.instances import ProcessIdentity

PROC = Path("/proc")
SHM = Path("/dev/shm")  # noqa: S108 - the POSIX shared-memory folder, not a temp file


def _stat_fields(pid: int) -> list[str] | None:
    try:
        return (PROC / str(pid) / "stat").read_text().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return None


def identity(pid: int) -> ProcessIdentity | None:
    """The process as it is now: PID, process group, start time."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    # After the ") ": state(0) ppid(1) pgrp(2) ... starttime is field 22 overall, index 19 here.
    return ProcessIdentity(pid=pid, pgid=int(fields[2]), start_ticks=int(fields[19]))


def is_alive(recorded: ProcessIdentity) -> bool:
    """The recorded process still runs (same PID *and* start time; a zombie has ended)."""
    fields = _stat_fields(recorded.pid)
    return fields is not None and fields[0] != "Z" and int(fields[19]) == recorded.start_ticks


def group_members(pgid: int) -> list[int]:
    """Live processes of a process group (the group outlives its leader)."""
    members = []
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None and fields[0] != "Z" and int(fields[2]) == pgid:
                members.append(int(entry.name))
    return members


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
