"""Starting one engine: its log writer, the engine itself, readiness, and tearing it down.

While an engine starts, hostd notes its processes, the /dev/shm segments they map or hold
open, and the children of its leader that have settled in. For an engine whose capabilities
say its children live as long as it does (SGLang's scheduler and detokenizer), losing one
while starting fails the launch at once: SGLang's HTTP server would wait on. Tearing down
removes the segments named after the launch's processes and those its processes held that
were not there before it started, once no process holds them.

A starting engine is asked whether it is ready every `READY_POLL_S`, so it is seen ready
within tens of milliseconds of its own readiness; the walk of /proc that notes its processes
runs less often (`REMEMBER_EVERY_S`): on a busy host it takes longer than a probe.

hostd talks to an engine through one HTTP client per kind of timeouts, made at the first call
and kept until the engine is torn down: a client and a connection made per load reading, park
or wake cost CPU on the path of every switch. A kept connection is dropped after
`KEEPALIVE_S` idle, well before the engine's own server closes it (uvicorn's 5 s), so a call
never goes out on a connection the engine is closing.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

from capycommon.domain.instances import ProcessIdentity
from capycommon.engines.adapters import adapter_for
from capycommon.engines.control import EngineControl, Timeouts
from capycommon.engines.environment import PROMETHEUS_DIR
from capycommon.engines.launch import LaunchPlan, LaunchSpec
from capycommon.errors import LaunchFailed
from capyctl_hostd import procs

LOG_TAIL_LINES = 20
# A child of the leader that has run this long is part of the engine, not a passing helper
# (ldconfig, a compiler); one that then dies while the engine starts fails the launch.
CHILD_SETTLED_S = 1.0
# The log writer ends once the engine's processes closed their output.
WRITER_END_S = 5.0
# A probe of a starting engine: a refused connection or a 503 costs it next to nothing.
READY_POLL_S = 0.02
REMEMBER_EVERY_S = 0.2
# The end of an engine's log that `tail` reads: enough for its last lines, however long it is.
TAIL_BYTES = 64 * 1024
# An idle connection to an engine is kept this long for the next call.
KEEPALIVE_S = 2.0


@dataclass
class Engine:
    """A running engine hostd knows: started here, or adopted after a restart."""

    spec: LaunchSpec
    pgid: int
    log_path: Path
    process: subprocess.Popen[bytes] | None = None  # None when adopted
    pids: set[int] = field(default_factory=set)
    writer: subprocess.Popen[bytes] | None = None  # the log writer (None when adopted)
    # The /dev/shm entries before the launch (None when adopted: then only those named after
    # its processes are its own), and the segments its processes were seen to hold.
    shm_before: frozenset[str] | None = None
    segments: set[str] = field(default_factory=set)
    # Settled children of the leader: PID -> start ticks.
    children: dict[int, int] = field(default_factory=dict)
    # The engine's control clients, by their timeouts (None: the defaults), kept until
    # `close_controls`.
    controls: dict[Timeouts | None, EngineControl] = field(default_factory=dict)

    def control(self, timeouts: Timeouts | None = None) -> EngineControl:
        """The engine's control client for these timeouts: made at the first call, then the
        same one (and its kept connection) until the engine is torn down."""
        found = self.controls.get(timeouts)
        if found is None:
            transport = httpx.AsyncHTTPTransport(
                verify=_tls(), limits=httpx.Limits(keepalive_expiry=KEEPALIVE_S)
            )
            adapter = adapter_for(self.spec.profile.family)
            found = self.controls[timeouts] = adapter.control(self.spec, timeouts, transport)
        return found

    async def close_controls(self) -> None:
        """Close the engine's control clients (and their connections)."""
        controls = list(self.controls.values())
        self.controls.clear()
        for control in controls:
            await control.aclose()

    def remember(self) -> None:
        """Note the group's processes, the /dev/shm segments they hold and the leader's
        settled children."""
        members = procs.group_members(self.pgid)
        self.pids.update(members)
        self.segments.update(procs.shm_held_by(members))
        for pid, ticks in procs.settled_children(self.pgid, members, CHILD_SETTLED_S).items():
            self.children.setdefault(pid, ticks)

    def lost_child(self) -> int | None:
        """A settled child of the leader that is gone, if any."""
        for pid, ticks in self.children.items():
            if not procs.is_alive(ProcessIdentity(pid=pid, pgid=self.pgid, start_ticks=ticks)):
                return pid
        return None

    def launch_segments(self) -> list[str]:
        """The /dev/shm segments this launch made: named after its processes, or held by them
        and not there before it started."""
        named = set(procs.shm_segments_of(self.pids | {self.pgid}))
        made = set() if self.shm_before is None else self.segments - self.shm_before
        return sorted(named | made)

    def exit_code(self) -> int | None:
        """The exit code once the engine ended (None while it runs or when unknown)."""
        return None if self.process is None else self.process.poll()


@functools.cache
def _tls() -> ssl.SSLContext:
    """One TLS context for every transport: each would load the CA bundle otherwise (tens of
    milliseconds of CPU), for engines reached over plain HTTP on loopback."""
    return ssl.create_default_context()


def spawn(
    spec: LaunchSpec,
    plan: LaunchPlan,
    env: dict[str, str],
    log_path: Path | None,
    secret: str,
    shared: subprocess.Popen[bytes] | None = None,
) -> Engine:
    """Start the log writer and the engine, each in a session of its own.

    The engine writes to the log writer's stdin; neither depends on hostd, so both outlive a
    restart of hostd. With no `log_path` (retention: zero) the writer keeps the last lines in
    its memory only (`memory_log`), and the engine runs with no core dump
    (`capyctl_hostd.nocore`). A `shared`
    writer (its LMCache server's, which owns it and waits for it) takes the engine's output
    instead of one of its own.
    """
    cwd = spec.runtime_dir
    before = procs.shm_names()
    if log_path is None:
        nocore = [sys.executable, "-I", "-m", "capyctl_hostd.nocore", *_program(plan.argv, env)]
        memory = _writer(["--memory", str(memory_log(spec.runtime_dir))], secret)
        assert memory.stdin is not None
        try:
            engine = _engine_process(nocore, env, cwd, memory.stdin)
        finally:
            memory.stdin.close()
        return Engine(spec, engine.pid, Path(os.devnull), engine, writer=memory, shm_before=before)
    writer = shared or open_log(log_path, secret)
    assert writer.stdin is not None
    try:
        engine = _engine_process(plan.argv, env, cwd, writer.stdin)
    finally:
        writer.stdin.close()
    own = None if shared is not None else writer
    return Engine(spec, engine.pid, log_path, engine, writer=own, shm_before=before)


def open_log(log_path: Path, secret: str) -> subprocess.Popen[bytes]:
    """A launch's log writer (`capyctl_hostd.logwriter`), redacting `secret`; whoever starts
    a process writing to it closes its stdin once the last such process is started."""
    log_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    return _writer([str(log_path)], secret)


def memory_log(runtime_dir: Path) -> Path:
    """The socket on which a launch that keeps no log file (retention: zero) serves the last
    lines its writer holds in memory."""
    return runtime_dir / "log.sock"


def _writer(args: list[str], secret: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "capyctl_hostd.logwriter", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={"CAPYCTL_REDACT": secret, "PATH": "/usr/bin:/bin"},
        start_new_session=True,
    )


def _engine_process(
    argv: list[str], env: dict[str, str], cwd: Path, output: IO[bytes] | int
) -> subprocess.Popen[bytes]:
    """The engine's process, in a session of its own, its output and errors to `output`."""
    return subprocess.Popen(
        argv,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=output,
        stderr=subprocess.STDOUT,
        cwd=cwd,
        start_new_session=True,
    )


def _program(argv: list[str], env: dict[str, str]) -> list[str]:
    """`argv` with its program as a path, found on the engine's own PATH as exec would."""
    program = argv[0]
    if "/" not in program:
        found = shutil.which(program, path=env.get("PATH"))
        if found is None:
            raise LaunchFailed(f"{program} is not on the engine's PATH ({env.get('PATH')})")
        program = found
    return [program, *argv[1:]]


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    """The last lines of an engine log (already redacted by the log writer), read from its
    end: a long-running engine's log may be large, and hostd reads its tail at each state."""
    try:
        with path.open("rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            start = max(0, size - TAIL_BYTES)
            handle.seek(start)
            found = handle.read().decode(errors="replace").splitlines()
    except OSError:
        return []
    if start > 0:
        found = found[1:]  # the first line read may be the end of a longer one
    return found[-lines:] if lines > 0 else []


def memory_tail(held: bytes, lines: int) -> list[str]:
    """The last lines of a log kept in memory, from its last TAIL_BYTES as a file's: the
    tail goes through Redis as one value, and Redis takes none over its proto-max-bulk-len."""
    found = held[-TAIL_BYTES:].decode(errors="replace").splitlines()
    if len(held) > TAIL_BYTES:
        found = found[1:]  # the first line kept may be the end of a longer one
    return found[-lines:] if lines > 0 else []


async def wait_ready(engine: Engine, control: EngineControl, deadline_s: float) -> None:
    """Until the engine reports ready; fail at once if it exits, or at the deadline."""
    started = time.monotonic()
    remembered = float("-inf")
    children_live = control.capabilities.children_live_with_engine
    while True:
        check_running(engine, "while starting")
        if await control.ready():
            return
        if time.monotonic() - remembered >= REMEMBER_EVERY_S:
            remembered = time.monotonic()
            if engine.process is None and not procs.group_members(engine.pgid):
                raise LaunchFailed(_exited(engine, "is gone"))
            engine.remember()
            lost = engine.lost_child() if children_live else None
            if lost is not None:
                raise LaunchFailed(
                    _exited(
                        engine,
                        f"lost its child process {lost} (a scheduler "
                        "or detokenizer) while starting",
                    )
                )
        if time.monotonic() - started > deadline_s:
            raise LaunchFailed(_exited(engine, f"was not ready within {deadline_s:g} s"))
        await asyncio.sleep(READY_POLL_S)


def check_running(engine: Engine, when: str) -> None:
    """Fail with the engine's last log lines if the process hostd started has exited."""
    code = engine.exit_code()
    if code is not None:
        raise LaunchFailed(_exited(engine, f"exited with code {code} {when}"))


def _exited(engine: Engine, what: str) -> str:
    return f"the {engine.spec.profile.family} engine {what}; {last_lines(engine.log_path)}"


def last_lines(path: Path, empty: str = "no output") -> str:
    """The log's last lines for a failure's reason; what there is when none is kept."""
    if path == Path(os.devnull):
        return "its log is not kept (retention: zero)"
    return f"last log lines: {' | '.join(tail(path, 8)) or empty}"


async def first_canary(engine: Engine, control: EngineControl) -> str:
    """A new engine's canary, while a thread checks that the engine alone listens on its port
    (a walk of /proc; the two overlap). A second listener fails the launch whatever the
    canary answered: the answer may have come from that listener."""
    alone = asyncio.create_task(
        asyncio.to_thread(check_port_is_ours, engine.spec.port, engine.pgid)
    )
    try:
        return await control.canary()
    finally:
        await alone  # its port_conflict is the error to tell, even when the canary failed


def check_port_is_ours(port: int, pgid: int) -> None:
    """The engine alone listens on its port; a second listener would take part of its
    connections (and answer them with another key)."""
    if procs.foreign_listeners(port, pgid):
        raise LaunchFailed(
            f"port_conflict: another process also listens on 127.0.0.1:{port}, so requests "
            "would be split between them; give each CapyCTL host on this machine its own "
            "host.engine_ports"
        )


async def tear_down(engine: Engine) -> list[str]:
    """Stop the group, wait until it is gone (and its log written), remove the /dev/shm
    segments the launch made and its Prometheus folder."""
    await engine.close_controls()
    engine.remember()
    await procs.stop_group(engine.pgid)
    if engine.process is not None:
        engine.process.wait()
    if engine.writer is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            await asyncio.to_thread(engine.writer.wait, WRITER_END_S)
    return _clean(engine.spec.runtime_dir, engine.launch_segments())


async def tear_down_group(pgid: int, runtime_dir: Path) -> list[str]:
    """Stop a launch's group that hostd holds no engine for (one its own record names) and
    clean what it left, as for an adopted engine: the segments named after its processes."""
    pids = {pgid, *procs.group_members(pgid)}
    await procs.stop_group(pgid)
    return _clean(runtime_dir, procs.shm_segments_of(pids))


def _clean(runtime_dir: Path, segments: list[str]) -> list[str]:
    """Remove the launch's Prometheus folder and those of `segments` no process holds."""
    shutil.rmtree(runtime_dir / PROMETHEUS_DIR, ignore_errors=True)
    return procs.remove_segments(segments)


def end_log(path: Path, line: str) -> None:
    """CapyCTL's own last line in an engine's log, once its processes and writer are done."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "a") as handle:
            handle.write(line.rstrip("\n") + "\n")
