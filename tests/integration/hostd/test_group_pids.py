"""hostd attributes a reading's device bytes to an engine by the process group of each PID the
reading names, read from that PID's own /proc entry."""

from __future__ import annotations

import os
import subprocess
import sys

from capyctl_hostd import procs


def test_in_group_keeps_the_live_members_of_the_group_among_the_pids() -> None:
    leader = subprocess.Popen(
        [sys.executable, "-c", "import signal; signal.pause()"], start_new_session=True
    )
    ended = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    ended.wait()  # reaped: its PID names no process now
    try:
        pids = [os.getpid(), leader.pid, ended.pid]
        assert procs.in_group(pids, leader.pid) == [leader.pid]
        assert procs.in_group(pids, leader.pid) == [
            pid for pid in procs.group_members(leader.pid) if pid in pids
        ]
        assert procs.in_group([os.getpid()], leader.pid) == []
    finally:
        leader.kill()
        leader.wait()
