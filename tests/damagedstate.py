"""A role's Redis data damaged on purpose, for the tests that a damaged state stops the role
with a repair that works (tests/e2e/test_damaged_*.py).

`saved_state` leaves a stopped role's state dir whose Redis keeps a manifest, a base file (its
last rewrite) and an incremental file: BEFORE was written before the rewrite and lives in the
base, AFTER after it, in the incremental file, and then a transaction. Each test damages a
copy, starts the role as a person does, runs the commands of its refusal as they are
written, and starts it again."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis

from capyctl_cli.programs import REDIS_START_RETRIES
from ports import free_port
from support import CAPYCTL, processes_mentioning, short_dir, start_role, wait_for

BEFORE = "test:before-rewrite"
AFTER = "test:after-rewrite"
MANIFEST = "appendonly.aof.manifest"
BASE = "appendonly.aof.2.base.rdb"
INCR = "appendonly.aof.2.incr.aof"


def client(state: Path) -> redis.Redis:
    return redis.Redis(unix_socket_path=str(state / "redis" / "redis.sock"))


@contextmanager
def saved_state() -> Iterator[Path]:
    """A stopped role's state dir: BEFORE in the base file of a rewrite (Redis's second: the
    first made its empty base at the role's first start), AFTER in the incremental file
    written since."""
    role = start_role()
    try:
        with client(role.state_dir) as redis_client:
            redis_client.set(BEFORE, "kept in the base")
            redis_client.bgrewriteaof()
            manifest = role.state_dir / "redis" / "appendonly" / MANIFEST
            wait_for(lambda: BASE in manifest.read_text(), timeout=30, what="the rewrite")
            redis_client.set(AFTER, "kept in the incremental file")
            with redis_client.pipeline(transaction=True) as transaction:
                transaction.set(f"{AFTER}:1", "one").set(f"{AFTER}:2", "two").execute()
        assert role.stop() == 0
        yield role.state_dir
    finally:
        role.stop()
        shutil.rmtree(role.state_dir.parent, ignore_errors=True)


@contextmanager
def copy_of(saved: Path) -> Iterator[Path]:
    """A copy of the saved state dir, removed after."""
    state = short_dir() / "state"
    shutil.copytree(saved, state, symlinks=True)
    try:
        yield state
    finally:
        shutil.rmtree(state.parent, ignore_errors=True)


def overwrite(path: Path, at: int) -> None:
    """Bytes Redis cannot read at `at`: not a torn tail, which Redis loads on its own, but a
    record it cannot parse."""
    data = path.read_bytes()
    assert len(data) > at + 64, f"{path.name} holds only {len(data)} bytes"
    path.write_bytes(data[:at] + b"XXXX" + data[at + 4 :])


def tear(path: Path) -> None:
    """Cut the file's last record short, as a crash mid-write does."""
    path.write_bytes(path.read_bytes()[:-5])


def split(aof: Path, in_transaction: bool = False) -> Path:
    """Cut the incremental file in two at a record boundary and list both, as a rewrite that
    failed leaves them; returns the first, now not the last. `in_transaction`: the cut is
    after the first command of the transaction `saved_state` wrote (the scheduler's lease
    writes such), so the first file ends in it, with no EXEC."""
    data = (aof / INCR).read_bytes()
    start = data.rindex(b"MULTI\r\n") if in_transaction else len(data) // 2
    cut = data.index(b"\r\n*", start) + 2
    if in_transaction:
        cut = data.index(b"\r\n*", cut) + 2
    (aof / INCR).write_bytes(data[:cut])
    (aof / "appendonly.aof.3.incr.aof").write_bytes(data[cut:])
    (aof / MANIFEST).write_text(
        f"file {BASE} seq 2 type b\nfile {INCR} seq 2 type i\n"
        "file appendonly.aof.3.incr.aof seq 3 type i\n"
    )
    return aof / INCR


@dataclass(frozen=True)
class Damage:
    """What to do to the appendonly folder, what the refusal says (`{aof}`: the folder), and
    the keys the repaired role keeps and loses."""

    do: Callable[[Path], object]
    said: str
    kept: tuple[str, ...]
    lost: tuple[str, ...] = ()


def _start(state: Path) -> subprocess.CompletedProcess[str]:
    argv = [CAPYCTL, "start", "standalone", "--state-dir", str(state), "--host-name", "local"]
    argv += ["--listen", f"127.0.0.1:{free_port()}"]
    argv += ["--management-listen", f"127.0.0.1:{free_port()}"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=90, check=False)


def _messages(output: str) -> list[str]:
    """Each line as a person reads it: the launcher logs JSON lines off a terminal."""
    return [
        json.loads(line)["message"] if line.startswith("{") else line
        for line in output.splitlines()
    ]


def refused_then_repaired(saved: Path, damage: Damage) -> None:
    """The damaged role's start is refused (exit 30) with a repair; its commands, run as
    they are written, let the role start again with the keys that survive."""
    with copy_of(saved) as state:
        aof = state / "redis" / "appendonly"
        damage.do(aof)
        redis_log = state / "logs" / "redis.log"
        before = redis_log.read_bytes()
        began = time.monotonic()
        found = _start(state)
        took = time.monotonic() - began
        said = found.stdout + found.stderr
        assert found.returncode == 30, said
        assert damage.said.format(aof=aof) in said
        assert "Traceback" not in said
        assert took < 60, f"the role took {took:.0f} s to give up"
        # Two failed starts tell the launcher, when it catches Redis between two starts; which
        # start that is depends on timing, but supervisord's own retries bound them all.
        starts = redis_log.read_bytes()[len(before) :].count(b"Redis is starting")
        most = REDIS_START_RETRIES + 1
        assert starts <= most, f"Redis started {starts} times before the role gave up"
        assert processes_mentioning(str(state)) == []

        (told,) = [line for line in _messages(said) if line.startswith("error [state_corrupt]")]
        for command in re.findall(r"`([^`]+)`", told):
            done = subprocess.run(
                ["bash", "-c", command], input="y\n", capture_output=True, text=True, check=False
            )
            assert done.returncode == 0, f"{command}: {done.stdout}{done.stderr}"
        again = start_role(state_dir=state)
        with client(state) as redis_client:
            assert [redis_client.exists(key) for key in damage.kept] == [1] * len(damage.kept)
            assert [redis_client.exists(key) for key in damage.lost] == [0] * len(damage.lost)
        assert again.stop() == 0
