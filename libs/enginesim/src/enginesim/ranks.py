"""Child processes that hold device memory: vLLM's EngineCore, and one per tensor-parallel rank.

A holding child is told what to hold by lines on its stdin (the holder protocol):

- `<gpu_bytes> <host_bytes>`: hold that much; the child answers `ok` on stdout once an
  allocation is claimed (a release lands after the lag), so it is there when `set` returns.
- `die <rank> <code> <message>` (the message as a JSON string): rank `rank` prints the
  message on stderr, releases its memory and exits with `code` (the `rank_dies` fault). A
  child that holds its ranks through workers passes the line on to that rank's worker.

With a tensor-parallel size N > 1 the engine runs N rank processes (`enginesim.rank_worker`),
rank i on the i-th visible device: vLLM's EngineCore starts `VLLM::Worker_TP<i>`, SGLang's
server `sglang::scheduler_TP<i>`. They are children, not new sessions, so they share the
engine's process group and a group kill ends them all. Every rank holds the same: the regions
are sized per rank (its share of the weights and its own KV cache), and `Ranks` passes each
change to all of them, returning once every rank answered. A rank that exits while `Ranks`
was not closed is a death, which `Ranks.watch` reports.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import NoReturn

from enginesim.behaviour import Behaviour
from enginesim.gpu import Holder, SimDevice, visible_count
from enginesim.parallel import indivisible_heads
from enginesim.process import Process

# The interpreter, handed down to the children: one titled by its argv[0] finds no
# sys.executable of its own to start its own children with.
PYTHON_ENV = "ENGINESIM_PYTHON"
# A rank that exits this soon before its parent starts closing it (the whole group got
# SIGTERM at once) is part of the stop, not a death.
STOP_GRACE_S = 0.25


class ChildHolder:
    """A child process titled `title` (its argv[0]) running `python -m module args` that
    holds memory as the holder protocol tells it.

    `close` (and SIGTERM of its parent, which runs it) stops the child. SIGKILL of the parent
    leaves the child to its own rule for a parent gone (end of its stdin): vLLM's EngineCore
    stays and holds by default, as the real one does, until the group is killed.
    """

    def __init__(self, title: str, module: str, args: Sequence[str]) -> None:
        # argv[0] is the process title; PYTHONPATH lets that interpreter find our packages.
        python = python_executable()
        paths = os.pathsep.join(p for p in sys.path if p)
        env = dict(os.environ, PYTHONPATH=paths, **{PYTHON_ENV: python})
        self.proc = subprocess.Popen(
            [title, "-m", module, *args],
            executable=python,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            close_fds=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, line: str) -> bool:
        """Write one line of the protocol; False when the child is gone."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(f"{line}\n".encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            return False
        return True

    def answered(self) -> None:
        """Wait for the child's answer to an allocation (none comes when it is gone)."""
        assert self.proc.stdout is not None
        with contextlib.suppress(ValueError):
            self.proc.stdout.readline()

    def set(self, gpu_bytes: int, host_bytes: int) -> None:
        # A child that is gone is noticed by whoever watches it.
        if self.send(f"{gpu_bytes} {host_bytes}"):
            self.answered()

    def kill_rank(self, rank: int, code: int, message: str) -> None:
        self.send(die_line(rank, code, message))

    def exited(self) -> int | None:
        return self.proc.poll()

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(BrokenPipeError):
                    pipe.close()


def _stop(signum: int, frame: FrameType | None) -> None:
    # Once: a second SIGTERM (a group's, then the parent's) must not cut the release short.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise SystemExit(0)


def exit_on_stop_signals() -> None:
    """SIGTERM or SIGINT ends a holding child as an exit 0 (its `finally` releases); any
    later one is ignored while it releases."""
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)


def python_executable() -> str:
    """This process's interpreter: its own, else the one its parent handed down, else the
    binary it runs."""
    return sys.executable or os.environ.get(PYTHON_ENV) or os.readlink("/proc/self/exe")


def die_line(rank: int, code: int, message: str) -> str:
    return f"die {rank} {code} {json.dumps(message)}"


def die(holder: Holder, code: int, message: str) -> NoReturn:
    """A `die` line's crash of the rank this process holds: the message on stderr, the
    memory released, the exit status."""
    sys.stderr.write(message.rstrip("\n") + "\n")
    sys.stderr.flush()
    holder.close()
    os._exit(code)


def serve_lines(holder: Holder, on_die: Callable[[int, int, str], None]) -> None:
    """The holder protocol on this process's stdin, until it ends (the parent is gone)."""
    for line in sys.stdin.buffer:
        words = line.decode().split(maxsplit=3)
        if not words:
            continue
        if words[0] == "die":
            on_die(int(words[1]), int(words[2]), json.loads(words[3]))
            continue
        holder.set(int(words[0]), int(words[1]))
        with contextlib.suppress(BrokenPipeError):
            sys.stdout.write("ok\n")
            sys.stdout.flush()


def worker_args(rank: int, device: SimDevice | None, lag: float) -> list[str]:
    """A rank worker's arguments: its rank (its torch device index) and its device's claim."""
    args = ["--rank", str(rank), "--lag", str(lag)]
    if device is not None:
        args += ["--dir", str(device.folder), "--uuid", device.device.uuid]
    return args


class Ranks:
    """The ranks' processes, titled `<title><rank>`, rank i holding on `devices[i]` (None:
    simulation is off); a holder that passes each change to every rank."""

    def __init__(self, title: str, devices: Sequence[SimDevice | None], lag: float) -> None:
        self._closing = threading.Event()
        self.children = [
            ChildHolder(f"{title}{rank}", "enginesim.rank_worker", worker_args(rank, device, lag))
            for rank, device in enumerate(devices)
        ]

    @property
    def pids(self) -> list[int]:
        return [child.pid for child in self.children]

    def set(self, gpu_bytes: int, host_bytes: int) -> None:
        # Every rank allocates at once, as the real ranks do; the change is made once all
        # answered.
        told = [child for child in self.children if child.send(f"{gpu_bytes} {host_bytes}")]
        for child in told:
            child.answered()

    def kill_rank(self, rank: int, code: int, message: str) -> None:
        if 0 <= rank < len(self.children):
            self.children[rank].send(die_line(rank, code, message))

    def watch(self, on_death: Callable[[int, int], None]) -> None:
        """Call `on_death(rank, exit status)` (on a thread of its own) for a rank that exits
        while the ranks are not being closed."""
        for rank, child in enumerate(self.children):
            threading.Thread(
                target=self._wait, args=(rank, child, on_death), name=f"rank{rank}", daemon=True
            ).start()

    def _wait(self, rank: int, child: ChildHolder, on_death: Callable[[int, int], None]) -> None:
        code = child.proc.wait()
        if not self._closing.wait(STOP_GRACE_S):
            on_death(rank, code)

    def close(self) -> None:
        """Stop every rank (SIGTERM to all, then wait for each): each releases its claim."""
        self._closing.set()
        for child in self.children:
            child.terminate()
        for child in self.children:
            child.close()


def rank_devices(
    process: Process,
    ranks: int,
    devices: Sequence[SimDevice] | None,
    env: Mapping[str, str],
    refusal: Callable[[int, int], str],
) -> list[SimDevice] | None:
    """The devices of `ranks` tensor-parallel ranks, the first `ranks` of those visible; more
    ranks than visible devices is a crash at start with `refusal(ranks, visible)`."""
    visible = visible_count(env, devices)
    if ranks > 1 and visible is not None and visible < ranks:
        process.die(refusal(ranks, visible))
    return None if devices is None else list(devices[:ranks])


def check_heads(process: Process, model: Path, ranks: int, refusal: Callable[[int], str]) -> None:
    """A model whose head count `ranks` does not divide is a crash at start with
    `refusal(heads)`."""
    heads = indivisible_heads(model, ranks) if ranks > 1 else None
    if heads is not None:
        process.die(refusal(heads))


def arm_rank_death(
    process: Process, behaviour: Behaviour, ranks: int, kill: Callable[[int, int, str], None]
) -> None:
    """The `rank_dies` fault, counted from now (the engine is ready): `kill` tells its rank
    to die; a rank the engine does not run never does."""
    dies = behaviour.faults.rank_dies
    if dies is None or dies.rank >= ranks:
        return
    process.later(dies.after_seconds, lambda: kill(dies.rank, dies.exit_code, dies.message))
