"""Starting one engine: its log writer, the engine itself, readiness, and tearing it down."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from capycommon.engines.adapters import adapter_for
from capycommon.engines.control import EngineControl, Timeouts
from capycommon.engines.launch import LaunchPlan, LaunchSpec
from capycommon.errors import CapyError
from capyctl_hostd import procs

LOG_TAIL_LINES = 20


class LaunchFailed(CapyError):
    code = "launch_failed"


@dataclass
class Engine:
    """A running engine hostd knows: started here, or adopted after a restart."""

    spec: LaunchSpec
    pgid: int
    log_path: Path
    process: subprocess.Popen[bytes] | None = None  # None when adopted
    pids: set[int] = field(default_factory=set)

    def control(self, timeouts: Timeouts | None = None) -> EngineControl:
        return adapter_for(self.spec.profile.family).control(self.spec, timeouts)

    def exit_code(self) -> int | None:
        """The exit code once the engine ended (None while it runs or when unknown)."""
        return None if self.process is None else self.process.poll()

    def remember_pids(self) -> None:
        """Note the group's processes (children included) to find their /dev/shm segments."""
        self.pids.update(procs.group_members(self.pgid))


def spawn(
    plan: LaunchPlan, env: dict[str, str], log_path: Path, secret: str, cwd: Path
) -> subprocess.Popen[bytes]:
    """Start the log writer and the engine, each in a session of its own.

    The engine writes to the log writer's stdin; neither depends on hostd, so both outlive a
    restart of hostd.
    """
    log_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    writer = subprocess.Popen(
        [sys.executable, "-m", "capyctl_hostd.logwriter", str(log_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={"CAPYCTL_REDACT": secret, "PATH": "/usr/bin:/bin"},
        start_new_session=True,
    )
    assert writer.stdin is not None
    try:
        engine = subprocess.Popen(
            plan.argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=writer.stdin,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            start_new_session=True,
        )
    finally:
        writer.stdin.close()
    return engine


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    """The last lines of an engine log (already redacted by the log writer)."""
    try:
        with path.open(errors="replace") as handle:
            return [line.rstrip("\n") for line in deque(handle, maxlen=lines)]
    except OSError:
        return []


async def wait_ready(engine: Engine, deadline_s: float) -> None:
    """Until the engine reports ready; fail at once if it exits, or at the deadline."""
    started = time.monotonic()
    control = engine.control()
    try:
        while True:
            code = engine.exit_code()
            if code is not None:
                raise LaunchFailed(_exited(engine, f"exited with code {code} while starting"))
            if engine.process is None and not procs.group_members(engine.pgid):
                raise LaunchFailed(_exited(engine, "is gone"))
            if await control.ready():
                return
            if time.monotonic() - started > deadline_s:
                raise LaunchFailed(_exited(engine, f"was not ready within {deadline_s:g} s"))
            engine.remember_pids()
            await asyncio.sleep(0.2)
    finally:
        await control.aclose()


def _exited(engine: Engine, what: str) -> str:
    lines = " | ".join(tail(engine.log_path, 8)) or "no output"
    return f"the {engine.spec.profile.family} engine {what}; last log lines: {lines}"


async def canary(engine: Engine) -> str:
    control = engine.control()
    try:
        return await control.canary()
    finally:
        await control.aclose()


async def tear_down(engine: Engine) -> list[str]:
    """Stop the group, wait until it is gone, remove its /dev/shm segments."""
    engine.remember_pids()
    await procs.stop_group(engine.pgid)
    if engine.process is not None:
        engine.process.wait()
    return procs.remove_segments(procs.shm_segments_of(engine.pids | {engine.pgid}))
