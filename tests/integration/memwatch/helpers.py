"""Helpers for memwatch's tests: processes that hold simulated memory, instance records."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from capycommon.domain.instances import InstanceRecord, InstanceState, ProcessIdentity

GIB = 1 << 30
CLAIMER = Path(__file__).with_name("claimer.py")


class Claimer:
    """A real process (the leader of its own process group) holding simulated memory."""

    def __init__(self, folder: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(CLAIMER), str(folder)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.pid = self.proc.pid

    def send(self, line: str) -> str:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(f"{line}\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def claim(self, uuid: str, size: int, host_bytes: int = 0) -> None:
        assert self.send(f"claim {uuid} {size} {host_bytes}") == "ok"

    def child(self, uuid: str, size: int, host_bytes: int = 0) -> None:
        assert self.send(f"child {uuid} {size} {host_bytes}") == "ok"

    def pids(self) -> list[int]:
        return [int(p) for p in self.send("pid").split()]

    def identity(self) -> ProcessIdentity:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(") ", 1)[1].split()
        return ProcessIdentity(pid=self.pid, pgid=int(fields[2]), start_ticks=int(fields[19]))

    def kill(self) -> None:
        """SIGKILL the whole group: nobody removes the claims."""
        if self.proc.poll() is None:
            os.killpg(self.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()

    def __enter__(self) -> Claimer:
        return self

    def __exit__(self, *_: object) -> None:
        self.kill()


def record(
    state: InstanceState,
    process: ProcessIdentity | None,
    since: float,
    *,
    fingerprint: str | None = "fp-1",
    instance: int = 0,
) -> InstanceRecord:
    return InstanceRecord(
        deployment="chat",
        instance=instance,
        revision=3,
        generation=7,
        state=state,
        since=since,
        host="local",
        fingerprint=fingerprint,
        process=process,
    )
